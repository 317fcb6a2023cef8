"""The load-aware selection policy: the router's own in-flight count weighed with scraped engine load. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

from router.domain import RequestInfo


class LoadView(Protocol):
    """What the policy reads of a worker (router.domain.WorkerView with its engine-load fields)."""

    @property
    def id(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def engine_running(self) -> int: ...
    @property
    def engine_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def load_known(self) -> bool: ...


V = TypeVar("V", bound=LoadView)


class LoadAware:
    """Lowest score wins; equal scores take turns.

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
        self.waiting_weight = waiting_weight
        self.kv_weight = kv_weight
        self.kv_high = kv_high
        self.kv_full_penalty = kv_full_penalty
        self._turn = 0

    def score(self, view: LoadView) -> float:
        if not view.load_known:
            return float(view.in_flight)
        kv = self.kv_weight * view.kv_usage + (self.kv_full_penalty if view.kv_usage >= self.kv_high else 0.0)
        return max(view.in_flight, view.engine_running) + self.waiting_weight * view.engine_waiting + kv

    def select(self, candidates: Sequence[V], request: RequestInfo) -> V:
        scores = [round(self.score(view), 9) for view in candidates]  # rounded: float noise is not a difference
        best = min(scores)
        tied = [view for view, s in zip(candidates, scores, strict=True) if s == best]
        choice = tied[self._turn % len(tied)]
        self._turn += 1
        return choice
