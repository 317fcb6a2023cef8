"""Arrival schedules: when each request of a run is sent (Poisson, gamma-bursty, or all at once)."""

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ArrivalSpec:
    """Open-loop rate `qps` (math.inf = send as fast as the concurrency cap allows).

    `burstiness` is the gamma shape: 1.0 is Poisson, < 1 burstier, > 1 more regular;
    the mean gap stays 1/qps whatever the shape (as `vllm bench serve --burstiness`).
    """

    qps: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ValueError(f"qps must be > 0, got {self.qps}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def gaps(spec: ArrivalSpec) -> Iterator[float]:
    """Endless gaps in seconds between consecutive sends (0.0 for an infinite rate)."""
    rng = random.Random(spec.seed)
    scale = 1.0 / (spec.qps * spec.burstiness) if math.isfinite(spec.qps) else 0.0
    while True:
        yield rng.gammavariate(spec.burstiness, scale) if scale > 0 else 0.0


def offsets(spec: ArrivalSpec) -> Iterator[float]:
    """Endless send times relative to the start of the run; the first is 0.0."""
    t = 0.0
    for gap in gaps(spec):
        yield t
        t += gap


def schedule(spec: ArrivalSpec, n: int, duration_s: float | None = None) -> list[float]:
    """The first `n` send times, cut at `duration_s` when given (a run bounded in count and time)."""
    out: list[float] = []
    if n <= 0:
        return out
    for t in offsets(spec):
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
        if len(out) >= n:
            break
    return out
