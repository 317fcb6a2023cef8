"""The soak's verdict, pure: does any sampled quantity trend up after warm-up, is anything left at the end, did any
request fail in a way its kind does not allow.

A series is one quantity sampled once a minute (router RSS, a process group's open descriptors, the router's
requests in flight, an engine's KV usage). After the warm-up samples are dropped, the rest is cut in thirds and
the median of the last third is compared with the median of the first: medians, so one sample taken in a burst
does not decide, and thirds, so a rise that comes back down is not a trend. A series *grows* when that rise is
more than `rel` of the first third's median and more than the quantity's own noise floor (`floor`: a count of
descriptors or requests moves by a few with the load at the moment of the sample, and a KV usage of 0.4 % is
not 5 % of anything)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

REL = 0.05  # the target: flat within 5 % after warm-up


@dataclass(frozen=True)
class Kind:
    """How a series is judged: the least absolute rise that counts (the quantity's noise at a sample)."""

    floor: float
    unit: str


KINDS: dict[str, Kind] = {
    "rss_mib": Kind(16.0, "MiB"),  # allocator and caches move by a few MiB between samples
    "fds": Kind(8.0, "fds"),  # connections open and close with the load
    "in_flight": Kind(4.0, "requests"),
    "kv_usage": Kind(0.05, "fraction"),  # five points of the KV cache
}


@dataclass(frozen=True)
class Trend:
    name: str  # e.g. "router rss_mib"
    first: float  # median of the first third after warm-up
    last: float  # median of the last third
    grows: bool

    @property
    def change(self) -> float:
        """The rise as a fraction of the first third's median (0 when that is 0 and nothing rose)."""
        if self.first == 0:
            return 0.0 if self.last == 0 else float("inf")
        return (self.last - self.first) / self.first


def trend(name: str, kind: str, values: Sequence[float], warmup: int, rel: float = REL) -> Trend | None:
    """The series' trend after `warmup` samples, or None when fewer than three samples are left to judge."""
    kept = list(values[warmup:])
    if len(kept) < 3:
        return None
    third = max(1, len(kept) // 3)
    first, last = statistics.median(kept[:third]), statistics.median(kept[-third:])
    rise = last - first
    grows = rise > KINDS[kind].floor and rise > rel * abs(first)
    return Trend(name, first, last, grows)


@dataclass(frozen=True)
class Leftover:
    """What the stack still holds once the traffic stopped and it was given time to settle."""

    router: Mapping[str, float]  # in_flight, queued, worker_in_flight
    engines: Mapping[str, tuple[float, float]]  # name -> (running + waiting, KV usage)

    def left(self) -> list[str]:
        found = [f"router {k} {v:g}" for k, v in self.router.items() if v]
        for name, (running, kv) in self.engines.items():
            if running:
                found.append(f"{name} {running:g} requests")
            if kv:
                found.append(f"{name} KV {kv:.2%}")
        return found


@dataclass
class SoakVerdict:
    trends: list[Trend] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    unexpected: dict[str, int] = field(default_factory=dict)  # kind of request -> its unexpected outcomes
    judged: bool = True  # False: too short to judge any trend

    @property
    def ok(self) -> bool:
        return self.judged and not any(t.grows for t in self.trends) and not self.left and not self.unexpected

    def reasons(self) -> list[str]:
        why = [] if self.judged else ["too few samples after warm-up to judge a trend"]
        why += [f"{t.name} grew {t.first:g} -> {t.last:g} ({t.change:+.1%})" for t in self.trends if t.grows]
        why += [f"left at the end: {x}" for x in self.left]
        why += [f"{n} unexpected outcomes of {k}" for k, n in self.unexpected.items()]
        return why


def judge(
    series: Mapping[str, tuple[str, Sequence[float]]],
    warmup: int,
    leftover: Leftover,
    unexpected: Mapping[str, int],
) -> SoakVerdict:
    """`series`: name -> (kind, values in sample order). Fails on any growing series, anything left, any
    unexpected outcome; and when no series has enough samples after warm-up to be judged at all."""
    trends = [t for name, (kind, values) in series.items() if (t := trend(name, kind, values, warmup)) is not None]
    return SoakVerdict(trends, leftover.left(), {k: n for k, n in unexpected.items() if n}, judged=bool(trends))
