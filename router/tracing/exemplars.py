"""Which traced latency observations carry their trace id as an OpenMetrics exemplar: at most one per histogram
bucket per interval (1 s by default).

Why: OpenMetrics keeps one exemplar per bucket, the latest, and a scrape (every 15-30 s) shows only that one; at
100 % sampling every observation came with an exemplar that prometheus_client checked, built and stored under the
bucket's lock (about 6 us an observation, three a request: ~1.5 % of the router's CPU per request) only for the
next one to replace it. With the gate, a bucket's exemplar is set by the first traced observation that falls in
it each interval, so every bucket that saw a traced observation still shows a trace (a slow point links to a slow
trace: the bucket is the value's own), no older than the interval plus the scrape's age. Pure but for the clock
(injected); its memory is one entry per series and bucket (series are the router's bounded metric children).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

INTERVAL_S = 1.0  # a bucket's exemplar is refreshed at most this often


class ExemplarGate:
    """`admit(series, value)`: whether a traced observation of `value` on `series` (a histogram child) sets its
    bucket's exemplar now. `bounds` are the histogram's upper bounds (+Inf implied)."""

    def __init__(
        self, bounds: Sequence[float], interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._bounds = tuple(sorted(bounds))
        self._interval = interval_s
        self._clock = clock
        self._last: dict[tuple[int, int], float] = {}
        self.admitted = 0  # exemplars let through (a counter of work done, for the tests)

    def admit(self, series: object, value: float) -> bool:
        bucket = bisect.bisect_left(self._bounds, value)  # Prometheus buckets are `le`: value <= bound
        key = (id(series), bucket)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            return False
        self._last[key] = now
        self.admitted += 1
        return True
