"""One worker's health as an explicit state machine: active probes plus passive ejection with backoff. Pure.

    UNKNOWN ──probe ok──▶ UP ──probe failed / hard request failure / N soft failures in a row──▶ DOWN
       │                  ▲                                                                      │
       └──probe failed──▶ DOWN ◀──────────────── (ejected: held down until its backoff ends) ─────┘
                          └──probe ok once the backoff has ended──▶ UP

A hard failure (the worker refused or dropped the connection) ejects at once; soft ones (a 5xx answer, a
deadline) eject after `eject_after` in a row. Each ejection doubles the hold (`base_backoff` up to
`max_backoff`); a successful request resets the streak.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet: not used
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class HealthPolicy:
    eject_after: int = 3  # soft request failures in a row before ejection
    base_backoff: float = 1.0  # seconds the first ejection holds a worker out
    max_backoff: float = 30.0


class WorkerHealth:
    """Events in, state out. `now` is the caller's monotonic clock, in seconds."""

    def __init__(self, policy: HealthPolicy) -> None:
        self._policy = policy
        self.state = Health.UNKNOWN
        self.failures = 0  # soft request failures in a row
        self.ejections = 0  # ejections in a row (sets the backoff)
        self.held_until = 0.0

    @property
    def usable(self) -> bool:
        return self.state is Health.UP

    def on_probe_ok(self, now: float) -> bool:
        """The worker's /health answered 2xx. Returns True when this brought the worker back."""
        if self.state is Health.UP or now < self.held_until:
            return False
        self.state = Health.UP
        self.failures = 0
        return True

    def on_probe_failed(self, now: float) -> bool:
        """The worker's /health failed. Returns True when this took the worker out."""
        was_up = self.state is Health.UP
        self.state = Health.DOWN
        return was_up

    def on_request_ok(self, now: float) -> None:
        self.failures = 0
        self.ejections = 0

    def on_request_failed(self, now: float, *, hard: bool) -> bool:
        """A leg to the worker failed. Returns True when this ejected the worker."""
        self.failures += 1
        if self.state is Health.DOWN or not (hard or self.failures >= self._policy.eject_after):
            return False
        self.ejections += 1
        backoff = min(self._policy.max_backoff, self._policy.base_backoff * 2 ** (self.ejections - 1))
        self.state = Health.DOWN
        self.held_until = now + backoff
        self.failures = 0
        return True
