"""FIFO resources with a reservation calendar: the P->D network link and P's push writer thread."""

from dataclasses import dataclass


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
