"""Worker-selection policies: small named classes in one registry, chosen by configuration. Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from router.domain import RequestInfo, WorkerView
from router.errors import ConfigError
from router.loadaware import LoadAware


class Policy(Protocol):
    """Picks one of `candidates` (never empty, ordered by configuration) for `request`."""

    name: ClassVar[str]

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView: ...


class _FairTies:
    """Breaks ties between equally loaded workers in turn, so equal workers share the load."""

    def __init__(self) -> None:
        self._turn = 0

    def _pick(self, tied: Sequence[WorkerView]) -> WorkerView:
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice


class RoundRobin(_FairTies):
    name: ClassVar[str] = "round-robin"

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        return self._pick(candidates)


class LeastInFlight(_FairTies):
    """Fewest requests in flight through this router."""

    name: ClassVar[str] = "least-in-flight"

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        best = min(w.in_flight for w in candidates)
        return self._pick([w for w in candidates if w.in_flight == best])


class LeastLoaded(_FairTies):
    """Fewest requests in flight, then fewest outstanding prompt tokens (the decode default)."""

    name: ClassVar[str] = "least-loaded"

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        best = min((w.in_flight, w.outstanding_tokens) for w in candidates)
        return self._pick([w for w in candidates if (w.in_flight, w.outstanding_tokens) == best])


class LeastPrefillTokens(_FairTies):
    """Fewest outstanding prompt tokens still to prefill, then fewest requests (the prefill default)."""

    name: ClassVar[str] = "least-prefill-tokens"

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        best = min((w.outstanding_tokens, w.in_flight) for w in candidates)
        return self._pick([w for w in candidates if (w.outstanding_tokens, w.in_flight) == best])


REGISTRY: dict[str, Callable[[], Policy]] = {
    cls.name: cls for cls in (RoundRobin, LeastInFlight, LeastLoaded, LeastPrefillTokens, LoadAware)
}


def make_policy(name: str) -> Policy:
    try:
        return REGISTRY[name]()
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown selection policy {name!r}; known policies: {known}") from None
