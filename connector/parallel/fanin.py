"""Fan-out and fan-in of one transfer's legs under TP (pure state machines, no I/O, injected time).

``connector.parallel.topology`` splits a transfer into legs (P rank -> D rank); each leg is today's pairwise
transfer, driven by the per-leg machines (``rendezvous``, ``decode_rendezvous``). Three small pieces
aggregate the legs; each guarantee of connector/README.md then holds per rank:

* ``SourceSet`` (one request on one D rank; fan-in over its sources). Per source the leg ends ``DONE``
  (its data landed: ``Done`` after the WRITE), ``ENDED`` (nothing can land any more: a plain ``Failure``
  sent after the handle was released, or a ``CancelAck``) or ``UNSAFE`` (a quarantine or a lost link: a
  WRITE may still land until the hold deadline). The request is **received** only when every source is
  ``DONE``; it **fails** at the first failure (reported once, and every source still pending is sent a
  ``Cancel`` so it stops early); its blocks are **freed** only when every source is ``DONE`` or ``ENDED``,
  or at the hold deadline (G2: no WRITE of any leg into a freed block).
* ``RankFanIn`` (one request across the D engine's ranks, scheduler side). A failure reported by any rank
  fails the request at once and orders a cancel on every rank (the step plan reaches them all); the
  request is finished (vLLM may free its blocks) only when every rank reported its blocks freed.
* ``FanOut`` (one prefill on one P rank; fan-out over the D ranks it writes). P's blocks are released
  once every target's leg is over (its machine released, or the lease ended before that D rank's
  registration arrived); a WRITE in flight keeps its leg open (the leg machine decides when it is over).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field


class LegEnd(enum.Enum):
    PENDING = "pending"
    DONE = "done"  # data landed
    ENDED = "ended"  # nothing can land any more (plain Failure, CancelAck)
    UNSAFE = "unsafe"  # failed, but a WRITE may still land until the hold deadline


@dataclass(frozen=True)
class SourceOutcome:
    """What one event on a ``SourceSet`` asks for (each flag at most once over its life)."""

    failed: bool = False  # report the request failed now
    received: bool = False  # report it received with valid KV (every source DONE)
    freed: bool = False  # its blocks on this rank may be freed
    cancel: tuple[Hashable, ...] = ()  # sources to send a Cancel to


@dataclass
class SourceSet:
    """One request on one D rank: the legs from its sources (see the module docstring)."""

    sources: tuple[Hashable, ...]
    deadline: float
    ends: dict[Hashable, LegEnd] = field(default_factory=dict)
    failed: bool = False
    received: bool = False
    freed: bool = False

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("a request needs at least one source")
        self.ends = dict.fromkeys(self.sources, LegEnd.PENDING)

    def on_done(self, source: Hashable) -> SourceOutcome:
        return self._end(source, LegEnd.DONE)

    def on_failure(self, source: Hashable, quarantine: bool) -> SourceOutcome:
        return self._end(source, LegEnd.UNSAFE if quarantine else LegEnd.ENDED, failing=True)

    def on_cancel_ack(self, source: Hashable) -> SourceOutcome:
        return self._end(source, LegEnd.ENDED, failing=True)

    def on_link_lost(self, source: Hashable) -> SourceOutcome:
        """The link to a source's engine is gone: what it posted may still land (quarantine)."""
        return self._end(source, LegEnd.UNSAFE, failing=True)

    def on_abort(self) -> SourceOutcome:
        """vLLM finished the request while it waited: fail it and cancel every pending source."""
        return self._settle(failing=True)

    def on_deadline(self, now: float) -> SourceOutcome:
        if now < self.deadline or self.freed:
            return SourceOutcome()
        pending_failed = not self.failed and not self.received
        self.failed = self.failed or pending_failed
        self.freed = True
        return SourceOutcome(failed=pending_failed, freed=True)

    def _end(self, source: Hashable, end: LegEnd, failing: bool = False) -> SourceOutcome:
        current = self.ends.get(source)
        if current is None or self.freed:
            return SourceOutcome()  # not a source of this request, or already freed: nothing to do
        if current is LegEnd.PENDING or (current is LegEnd.UNSAFE and end in (LegEnd.DONE, LegEnd.ENDED)):
            self.ends[source] = end  # an UNSAFE leg that later ends cleanly is safe again
        return self._settle(failing)

    def _settle(self, failing: bool) -> SourceOutcome:
        fail_now = (failing or LegEnd.UNSAFE in self.ends.values()) and not self.failed and not self.received
        if fail_now:
            self.failed = True
        cancel = (
            tuple(s for s, e in self.ends.items() if e is LegEnd.PENDING) if fail_now else ()
        )  # the others stop early: their CancelAck (or Done) ends them
        receive = not self.failed and not self.received and all(e is LegEnd.DONE for e in self.ends.values())
        self.received = self.received or receive
        free = not self.freed and all(e in (LegEnd.DONE, LegEnd.ENDED) for e in self.ends.values())
        self.freed = self.freed or free
        return SourceOutcome(failed=fail_now, received=receive, freed=free, cancel=cancel)


@dataclass(frozen=True)
class RankOutcome:
    cancel_everywhere: bool = False  # order a cancel for the request on every rank (first failure)
    finished: bool = False  # every rank freed: vLLM may free the blocks
    ok: bool = False  # with ``finished``: every rank received valid KV


@dataclass
class RankFanIn:
    """One request across the D engine's ranks (scheduler side)."""

    ranks: int
    failed: bool = False
    freed: set[int] = field(default_factory=set)

    def on_rank_failed(self, rank: int) -> RankOutcome:
        first = not self.failed
        self.failed = True
        return RankOutcome(cancel_everywhere=first and len(self.freed) < self.ranks)

    def on_rank_freed(self, rank: int) -> RankOutcome:
        if not 0 <= rank < self.ranks or rank in self.freed:
            return RankOutcome()
        self.freed.add(rank)
        done = len(self.freed) == self.ranks
        return RankOutcome(finished=done, ok=done and not self.failed)


@dataclass
class FanOut:
    """One prefill on one P rank: its blocks are released once every target's leg is over."""

    targets: tuple[int, ...]
    registered: set[int] = field(default_factory=set)
    over: set[int] = field(default_factory=set)
    released: bool = False

    def on_registration(self, d_rank: int) -> bool:
        """A leg starts; False: not a target, or the leg already ended (refuse: answer with a Failure)."""
        if d_rank not in self.targets or d_rank in self.over or self.released:
            return False
        self.registered.add(d_rank)
        return True

    def on_leg_over(self, d_rank: int) -> bool:
        """The leg machine released (Done sent, failed, cancelled, expired). True: release P's blocks now."""
        if d_rank in self.targets:
            self.over.add(d_rank)
        return self._release_if_all_over()

    def on_lease_expired(self) -> bool:
        """Targets whose registration never came are over; running legs end through their machines."""
        self.over |= set(self.targets) - self.registered
        return self._release_if_all_over()

    def _release_if_all_over(self) -> bool:
        if self.released or not set(self.targets) <= self.over:
            return False
        self.released = True
        return True
