"""Worker-selection policies: small named classes in one registry, chosen and parametrised by configuration. Pure.

    policy: {decode: least-loaded, prefill: {name: load-aware, waiting_weight: 3}}

Each registry entry is a factory taking the policy's own options (the mapping minus `name`); it refuses unknown
options and bad values with a ConfigError, so a mistake is reported at startup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

from router import values
from router.domain import RequestInfo, WorkerView
from router.errors import ConfigError


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


class LoadAware(_FairTies):
    """The router's own in-flight count weighed with the engine load scraped from each worker's /metrics.
    Lowest score wins; equal scores take turns.

    score = max(router in-flight, engine running) + waiting_weight × engine waiting + kv_weight × KV usage
            (+ kv_full_penalty once KV usage reaches kv_high: such a worker is about to preempt)

    The router's own in-flight count is live, the scraped numbers are up to one scrape old; taking the larger of
    in-flight and running counts other routers' requests without losing our own burst. A worker whose load is not
    known (not scraped yet, or its last scrape failed) scores by in-flight alone."""

    name: ClassVar[str] = "load-aware"

    def __init__(
        self,
        *,
        waiting_weight: float = 2.0,
        kv_weight: float = 4.0,
        kv_high: float = 0.95,
        kv_full_penalty: float = 1000.0,
    ) -> None:
        super().__init__()
        self.waiting_weight = waiting_weight
        self.kv_weight = kv_weight
        self.kv_high = kv_high
        self.kv_full_penalty = kv_full_penalty

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LoadAware:
        _known(cls.name, options, {"waiting_weight", "kv_weight", "kv_high", "kv_full_penalty"})
        where = f"policy {cls.name}"
        checked: dict[str, float] = {
            key: values.number(value, f"{where}: {key}", high=1.0 if key == "kv_high" else None)
            for key, value in options.items()
        }
        return cls(**checked)

    def score(self, view: WorkerView) -> float:
        if not view.load_known:
            return float(view.in_flight)
        kv = self.kv_weight * view.kv_usage + (self.kv_full_penalty if view.kv_usage >= self.kv_high else 0.0)
        return max(view.in_flight, view.engine_running) + self.waiting_weight * view.engine_waiting + kv

    def select(self, candidates: Sequence[WorkerView], request: RequestInfo) -> WorkerView:
        scores = [round(self.score(view), 9) for view in candidates]  # rounded: float noise is not a difference
        best = min(scores)
        return self._pick([view for view, s in zip(candidates, scores, strict=True) if s == best])


PolicyFactory = Callable[[Mapping[str, Any]], Policy]  # takes the policy's own options


def _known(name: str, options: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(options) - known
    if unknown:
        takes = f"its options are {', '.join(sorted(known))}" if known else "it takes no options"
        raise ConfigError(f"policy {name}: unknown option(s) {sorted(map(str, unknown))}; {takes}")


def _plain(cls: Callable[[], Policy], name: str) -> PolicyFactory:
    def factory(options: Mapping[str, Any]) -> Policy:
        _known(name, options, set())
        return cls()

    return factory


REGISTRY: dict[str, PolicyFactory] = {
    **{cls.name: _plain(cls, cls.name) for cls in (RoundRobin, LeastInFlight, LeastLoaded, LeastPrefillTokens)},
    LoadAware.name: LoadAware.from_options,
}


def make_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` with its `options` (checked by its factory)."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ConfigError(f"unknown selection policy {name!r}; known policies: {known}") from None
    return factory(options or {})
