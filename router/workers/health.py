"""One worker's health as an explicit state machine: active probes plus passive ejection with backoff. Pure.

    UNKNOWN ──probe ok──▶ UP ──probe failed / M probe timeouts / hard request failure / N soft failures──▶ DOWN
       │                  ▲                                                                              │
       └──probe failed──▶ DOWN ◀──────────────────── (ejected: held down until its backoff ends) ──────────┘
                          └──probe ok once the backoff has ended──▶ UP

A probe that fails outright (refused, reset, a non-2xx answer) takes an UP worker down at once. A probe that
times out takes it down only at the `probe_timeouts`-th timeout in a row (the pool sends the confirming probe at
once): vLLM answers /health from its API process without asking the engine, so a busy engine answers in
milliseconds and two timeouts in a row mean a hung process (SIGSTOP, a wedged event loop), while one slow answer
from a starved API process does not cost the legs in flight on that worker. Nor does a timeout while the worker
answers legs: one answered within `alive_window` proves the engine alive, so the timeout is not counted (a
starved box, where the API process answers /health late while it serves; the soak of Dec 7 lost its only decode
to two such timeouts and answered 22 clients 503). A hung worker answers nothing, so its timeouts count once its
last answer is `alive_window` old.

A hard request failure (the worker refused or dropped the connection) ejects at once; soft ones (a 5xx answer,
a deadline) eject after `eject_after` in a row. Each ejection doubles the hold (`base_backoff` up to
`max_backoff`); a successful request resets the streak.

A prefill worker can also be *stalled*: its API process answers /health (so the probes see it up) while its
engine makes no progress, e.g. one tensor-parallel rank stopped (SIGSTOP) or wedged in a collective: the other
ranks wait for it and no leg is ever answered. Its legs' failures reach the router as the paired decode's errors
(the KV never came), so passive health does not see it either. `stalled` is the rule the pool applies on every
health round: a leg in flight on it has waited, since it began or since the worker last answered a leg (whichever
is later), longer than any healthy engine takes to prefill that leg (`stall_base` + `stall_per_token` per prompt
token). A stalled worker is ejected as by a hard failure (held out, its legs told at once, retried elsewhere).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
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
    alive_window: float = 2.0  # a leg answered this recently proves the worker alive: a probe timeout is not counted
    stall_base: float = 5.0  # seconds a prefill leg may wait without any answer from its worker, plus:
    stall_per_token: float = 0.001  # per prompt token of the leg (a 1000 tokens/s floor on prefill speed)

    def stall_budget(self, tokens: int) -> float:
        """Seconds a prefill leg of `tokens` prompt tokens may wait on a worker that answers nothing meanwhile."""
        return self.stall_base + self.stall_per_token * max(0, tokens)


def stalled(legs: Iterable[tuple[float, int]], last_answer: float, now: float, policy: HealthPolicy) -> bool:
    """Pure: whether a worker is stalled. `legs`: its legs in flight as (started, prompt tokens); `last_answer`:
    when it last answered a leg (its clock; 0 when never). A leg waits from its start or from the last answer,
    whichever is later: an engine that answered another leg meanwhile is making progress, and a leg queued
    behind answered ones is judged from the latest answer only."""
    return any(now - max(started, last_answer) > policy.stall_budget(tokens) for started, tokens in legs)


class WorkerHealth:
    """Events in, state out. `now` is the caller's monotonic clock, in seconds."""

    def __init__(self, policy: HealthPolicy) -> None:
        self._policy = policy
        self.state = Health.UNKNOWN
        self.failures = 0  # soft request failures in a row
        self.ejections = 0  # ejections in a row (sets the backoff)
        self.held_until = 0.0
        self.probe_timeouts = 0  # probe timeouts in a row
        self.last_ok = float("-inf")  # when a leg to it last succeeded

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
        if was_up and timed_out and now - self.last_ok < self._policy.alive_window:
            self.probe_timeouts = 0
            return False  # it answers legs: a late /health is a starved API process, not a hung worker
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
        self.last_ok = now
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
