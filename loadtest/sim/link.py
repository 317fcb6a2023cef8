"""The P->D network link and P's push writer thread, pure.

`Fifo`: one job at a time, first come first served, with a reservation calendar (the writer thread; the link
of the seed-scale process simulator). `FairShare`: the link as TCP flows through one shaper see it: every
transfer in flight gets an equal share of the rate, so two transfers that overlap each take longer than
alone, and a transfer's end is only known once no other joins before it (the caller drains the finished ones
as virtual time advances). `tcp_start_s`: what a transfer pays before it runs at its share (one round trip for
the request plus slow start's rounds up to the path's bandwidth-delay product).
"""

import math
from dataclasses import dataclass, field

EPS = 1e-12
INITIAL_WINDOW_BYTES = 10 * 1448  # Linux's initial congestion window: 10 segments


@dataclass
class Fifo:
    """One job at a time, first come first served; `reserve` says when a job of `seconds` would finish."""

    free_at: float = 0.0
    busy_s: float = 0.0

    def reserve(self, now: float, seconds: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at


@dataclass
class FairShare:
    """Transfers share the link's rate equally (processor sharing). A transfer is the seconds it takes alone;
    with k in flight each moves at 1/k of the rate. `add` a transfer at `now`, ask `next_finish` when the next
    one would end if none joined, `advance` to a time, and `drain` the (id, end time) of those that ended."""

    now: float = 0.0
    busy_s: float = 0.0
    _left: dict[int, float] = field(default_factory=dict)  # id -> seconds left at the full rate
    _ended: list[tuple[int, float]] = field(default_factory=list)
    _next_id: int = 0

    @property
    def in_flight(self) -> int:
        return len(self._left)

    def add(self, now: float, seconds: float) -> int:
        """Start a transfer of `seconds` (alone) at `now` (not before the link's present); its id."""
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"a transfer takes a finite, non-negative time, got {seconds}")
        self.advance(now)
        tid, self._next_id = self._next_id, self._next_id + 1
        self.busy_s += seconds
        if seconds <= EPS:
            self._ended.append((tid, now))
        else:
            self._left[tid] = seconds
        return tid

    def next_finish(self) -> float | None:
        """When the earliest transfer in flight ends if no other joins; None when idle."""
        if not self._left:
            return None
        return self.now + min(self._left.values()) * len(self._left)

    def advance(self, now: float) -> None:
        """Move the link to `now`: every transfer in flight progresses at its share; ended ones go to `drain`."""
        if now < self.now - EPS:
            raise ValueError(f"the link is at {self.now}, cannot go back to {now}")
        while self._left:
            end = self.next_finish()
            assert end is not None
            if end > now + EPS:
                break
            self._progress(end)
        if self._left:
            share = (now - self.now) / len(self._left)
            self._left = {k: v - share for k, v in self._left.items()}
        self.now = max(self.now, now)

    def _progress(self, end: float) -> None:
        step = (end - self.now) / len(self._left)
        left = {k: v - step for k, v in self._left.items()}
        for k in [k for k, v in left.items() if v <= EPS]:
            del left[k]
            self._ended.append((k, end))
        self._left, self.now = left, end

    def drain(self) -> list[tuple[int, float]]:
        """The transfers that ended since the last drain: (id, end time), in the order they ended."""
        out, self._ended = self._ended, []
        return out


def finish_times(transfers: list[tuple[float, float]]) -> list[float]:
    """When each transfer ends on a FairShare link: `transfers` are (start, seconds alone) in any order."""
    link = FairShare()
    ends: dict[int, float] = {}
    ids: dict[int, int] = {}
    for i in sorted(range(len(transfers)), key=lambda i: transfers[i][0]):
        start, seconds = transfers[i]
        while (nxt := link.next_finish()) is not None and nxt <= start:
            link.advance(nxt)
        ids[link.add(start, seconds)] = i
        ends.update({ids[t]: e for t, e in link.drain() if t in ids})
    while (nxt := link.next_finish()) is not None:
        link.advance(nxt)
    ends.update({ids[t]: e for t, e in link.drain()})
    return [ends[i] for i in range(len(transfers))]


def tcp_start_s(rtt_s: float, bytes_per_s: float, initial_window: int = INITIAL_WINDOW_BYTES) -> float:
    """The time a fresh (or idle-restarted) TCP transfer loses before it runs at the path's rate: one round trip
    for the first bytes, then one per slow-start doubling from the initial window to the bandwidth-delay
    product. 0 for an unlimited rate or no round trip."""
    if rtt_s < 0 or bytes_per_s <= 0:
        raise ValueError("need rtt_s >= 0 and a positive rate")
    if rtt_s == 0 or math.isinf(bytes_per_s):
        return 0.0
    bdp = bytes_per_s * rtt_s
    rounds = math.ceil(math.log2(bdp / initial_window)) if bdp > initial_window else 0
    return rtt_s * (1 + rounds)
