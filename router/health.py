"""One worker's health as an explicit state machine: active probes plus passive ejection with backoff. Pure.

    UNKNOWN ──probe ok──▶ UP ──probe failed / M probe timeouts / hard request failure / N soft failures──▶ DOWN
       │                  ▲                                                                              │
       └──probe failed──▶ DOWN ◀──────────────────── (ejected: held down until its backoff ends) ──────────┘
                          └──probe ok once the backoff has ended──▶ UP

A probe that fails outright (refused, reset, a non-2xx answer) takes an UP worker down at once. A probe that
times out takes it down only at the `probe_timeouts`-th timeout in a row (the pool sends the confirming probe at
once): vLLM answers /health from its API process without asking the engine, so a busy engine answers in
milliseconds and two timeouts in a row mean a hung process (SIGSTOP, a wedged event loop), while one slow answer
from a starved API process does not cost the legs in flight on that worker.

A hard request failure (the worker refused or dropped the connection) ejects at once; soft ones (a 5xx answer,
a deadline) eject after `eject_after` in a row. Each ejection doubles the hold (`base_backoff` up to
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
    probe_timeouts: int = 2  # probe timeouts in a row that take an UP worker down


class WorkerHealth:
    """Events in, state out. `now` is the caller's monotonic clock, in seconds."""

    def __init__(self, policy: HealthPolicy) -> None:
        self._policy = policy
        self.state = Health.UNKNOWN
        self.failures = 0  # soft request failures in a row
        self.ejections = 0  # ejections in a row (sets the backoff)
        self.held_until = 0.0
        self.probe_timeouts = 0  # probe timeouts in a row

    @property
    def usable(self) -> bool:
        return self.state is Health.UP

    def on_probe_ok(self, now: float) -> bool:
        """The worker's /health answered 2xx. Returns True when this brought the worker back."""
        self.probe_timeouts = 0
        if self.state is Health.UP or now < self.held_until:
            return False
        self.state = Health.UP
        self.failures = 0
        return True

    def on_probe_failed(self, now: float, *, timed_out: bool = False) -> bool:
        """The worker's /health failed (`timed_out`: no answer within the probe deadline). Returns True when this
        took the worker out."""
        self.probe_timeouts = self.probe_timeouts + 1 if timed_out else 0
        was_up = self.state is Health.UP
        if was_up and timed_out and self.probe_timeouts < self._policy.probe_timeouts:
            return False  # one slow answer: the pool confirms with another probe at once
        self.probe_timeouts = 0
        self.state = Health.DOWN
        return was_up

    @property
    def confirming(self) -> bool:
        """An UP worker whose last probe timed out: the next probe decides."""
        return self.state is Health.UP and self.probe_timeouts > 0

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
