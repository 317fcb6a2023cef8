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
    `stride`/`phase`: the stream is cut into blocks of `stride` consecutive arrivals and this load sends one
    arrival of each block, so `stride` loads with the same seed and rate, one per phase, share one stream in
    turn (fronts side by side). Which arrival of block j a phase takes is a permutation of the block drawn from
    the seed (a fair coin per block for two phases), so no phase is always first.
    """

    qps: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    stride: int = 1
    phase: int = 0

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ValueError(f"qps must be > 0, got {self.qps}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.stride < 1 or not 0 <= self.phase < self.stride:
            raise ValueError(f"need stride >= 1 and 0 <= phase < stride, got {self.stride} and {self.phase}")


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


def turns(spec: ArrivalSpec) -> Iterator[int]:
    """Endless: which arrival of each block of `stride` (0 .. stride-1) this load's phase takes."""
    rng = random.Random(f"turns-{spec.seed}")
    order = list(range(spec.stride))
    while True:
        rng.shuffle(order)
        yield order[spec.phase]


def schedule(spec: ArrivalSpec, n: int, duration_s: float | None = None) -> list[float]:
    """The first `n` send times of this load's share of the stream (one arrival per block of `stride`), cut
    at `duration_s` when given (a run bounded in count and time)."""
    out: list[float] = []
    if n <= 0:
        return out
    times, mine = offsets(spec), turns(spec)
    while len(out) < n:
        block = [next(times) for _ in range(spec.stride)]
        t = block[next(mine)]
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return out
