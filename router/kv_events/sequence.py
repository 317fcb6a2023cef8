"""One publisher's sequence, as a state machine: in sync, gap → replay, restart, removal. Pure.

A vLLM publisher numbers its messages 0, 1, 2, ... per process and keeps the last `buffer_steps` of them for
replay. The tracker of one stream (a worker, or one DP rank of it) decides, message by message, what the
subscriber does with it; the subscriber executes the returned operations in order (`Apply` a batch to the stream's
index, `Reset` the index, `RequestReplay`, `EndReplay`).

    FRESH ──seq 0──────────────────────────────▶ IN_SYNC ◀─────────────── replay ended / deadline ──┐
      │  seq > 0 (joined late) ─▶ REPLAY_REQUESTED(0)                                               │
    IN_SYNC ──seq > next (gap)──▶ REPLAY_REQUESTED(next) ──first answer──▶ REPLAYING ───────────────┘
    not FRESH ──live seq <= the last live one (the publisher restarted: its counter went back)──▶ Reset, as FRESH
    any ──restarted() (the pool saw the worker come back)──▶ Reset, FRESH
    any ──removed()──▶ Reset, REMOVED (everything after is ignored)

A live seq below `next_seq` but above the last live one was already replayed (the replay answered before the SUB
socket's queue was read) and is skipped. While a replay runs, live messages are held (at most `max_held`; more
ends the replay early) and applied after it. A seq that is missing for good (the publisher's replay buffer no
longer has it, it has no replay socket, the replay's deadline passed, or a message's batch could not be read) is
a *hole*: the events in it may have removed blocks, so the index is reset there and the stream is no longer
`complete` (it holds a subset of what the engine holds) until the engine clears its cache (`cache_cleared`). A
stream that starts at seq 0 or replays from 0 is complete. `caught_up` = in sync and complete: what the deciders
may trust alone.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class SeqState(enum.StrEnum):
    FRESH = "fresh"  # subscribed, nothing heard yet (or the publisher restarted)
    IN_SYNC = "in_sync"
    REPLAY_REQUESTED = "replay_requested"  # a gap: replay asked, no answer yet
    REPLAYING = "replaying"  # replay answers arriving
    REMOVED = "removed"  # the worker left: everything is ignored


@dataclass(frozen=True, slots=True)
class Apply(Generic[T]):
    seq: int
    item: T


@dataclass(frozen=True, slots=True)
class Reset:
    """Drop the stream's index: what comes next starts from empty."""


@dataclass(frozen=True, slots=True)
class RequestReplay:
    start: int


@dataclass(frozen=True, slots=True)
class EndReplay:
    """Close the replay request (its socket): answers still in flight must not be read."""


Op = Apply[T] | Reset | RequestReplay | EndReplay


@dataclass
class SeqCounters:
    gaps: int = 0  # seqs skipped on the live stream
    replays: int = 0  # replays requested
    replay_timeouts: int = 0  # replays that missed their deadline
    replay_cut: int = 0  # replays ended early: too many live messages held meanwhile
    holes: int = 0  # runs of seqs lost for good (index reset there)
    lost: int = 0  # messages whose batch could not be read (malformed, oversized)
    restarts: int = 0  # publisher restarts seen (seq went back, or told by the pool)
    duplicates: int = 0  # replayed or held messages already applied
    stale: int = 0  # replay answers after their replay ended


@dataclass
class SequenceTracker(Generic[T]):
    """One stream's sequence. `item` None stands for a message whose batch could not be read."""

    clock: Callable[[], float]
    can_replay: bool
    replay_timeout_s: float
    max_held: int
    counters: SeqCounters = field(default_factory=SeqCounters)
    state: SeqState = SeqState.FRESH
    next_seq: int = 0
    last_live: int = -1  # the highest seq seen on the live stream
    complete: bool = False
    _held: deque[tuple[int, T | None]] = field(default_factory=deque)
    _deadline: float = 0.0

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.max_held < 1:
            raise ValueError("a sequence tracker needs a positive replay deadline and room to hold one message")

    @property
    def caught_up(self) -> bool:
        return self.state is SeqState.IN_SYNC and self.complete

    @property
    def replaying(self) -> bool:
        return self.state in (SeqState.REPLAY_REQUESTED, SeqState.REPLAYING)

    # --- events ---------------------------------------------------------------------------------------------------

    def published(self, seq: int, item: T | None) -> list[Op[T]]:
        """A live message. The live stream only goes forward, so a seq at or below the last live one means the
        publisher restarted; one below `next_seq` but above the last live one was already replayed."""
        if self.state is SeqState.REMOVED:
            return []
        if self.state is SeqState.FRESH:
            self.last_live = seq
            return self._start(seq, item, [])
        if seq <= self.last_live:
            return self._restart(seq, item)
        self.last_live = seq
        if seq < self.next_seq:
            self.counters.duplicates += 1
            return []
        if self.state is SeqState.IN_SYNC:
            if seq == self.next_seq:
                return self._take(seq, item, [])
            self.counters.gaps += seq - self.next_seq
            return self._gap(seq, item, [])
        self._held.append((seq, item))
        if len(self._held) > self.max_held:
            self.counters.replay_cut += 1
            return self._finish_replay()
        return []

    def replayed(self, seq: int, item: T | None) -> list[Op[T]]:
        """An answer of the replay socket."""
        if not self.replaying:
            self.counters.stale += 1
            return []
        self.state = SeqState.REPLAYING
        if seq < self.next_seq:
            self.counters.duplicates += 1
            return []
        return self._take(seq, item, [])

    def replay_ended(self) -> list[Op[T]]:
        """The replay socket's end marker."""
        if not self.replaying:
            self.counters.stale += 1
            return []
        return self._finish_replay()

    def tick(self) -> list[Op[T]]:
        """Time passes: a replay past its deadline ends with what it got."""
        if self.replaying and self.clock() >= self._deadline:
            self.counters.replay_timeouts += 1
            return self._finish_replay()
        return []

    def cache_cleared(self) -> None:
        """The engine cleared its whole cache (an applied AllBlocksCleared): from here the index is complete."""
        if self.state is not SeqState.REMOVED:
            self.complete = True

    def restarted(self) -> list[Op[T]]:
        """The worker came back (the pool saw it restart): what the index held is gone."""
        if self.state is SeqState.REMOVED:
            return []
        self.counters.restarts += 1
        ops = self._drop()
        self.state = SeqState.FRESH
        return ops

    def removed(self) -> list[Op[T]]:
        if self.state is SeqState.REMOVED:
            return []
        ops = self._drop()
        self.state = SeqState.REMOVED
        return ops

    # --- transitions ----------------------------------------------------------------------------------------------

    def _start(self, seq: int, item: T | None, ops: list[Op[T]]) -> list[Op[T]]:
        """The first message since subscribing or since a restart."""
        self.next_seq = 0
        if seq == 0:
            self.complete = True
            self.state = SeqState.IN_SYNC
            return self._take(seq, item, ops)
        self.complete = True  # until a hole says otherwise: a replay from 0 may bring the whole history
        return self._gap(seq, item, ops)

    def _gap(self, seq: int, item: T | None, ops: list[Op[T]]) -> list[Op[T]]:
        """`seq` came, `next_seq` was expected: replay what is missing, or give it up."""
        if not self.can_replay:
            self.state = SeqState.IN_SYNC
            return self._take(seq, item, ops)
        self.counters.replays += 1
        self._held.clear()
        self._held.append((seq, item))
        self._deadline = self.clock() + self.replay_timeout_s
        self.state = SeqState.REPLAY_REQUESTED
        ops.append(RequestReplay(self.next_seq))
        return ops

    def _restart(self, seq: int, item: T | None) -> list[Op[T]]:
        self.counters.restarts += 1
        ops = self._drop()
        self.last_live = seq
        return self._start(seq, item, ops)

    def _drop(self) -> list[Op[T]]:
        ops: list[Op[T]] = [EndReplay()] if self.replaying else []
        ops.append(Reset())
        self._held.clear()
        self.complete = False
        self.next_seq = 0
        self.last_live = -1
        return ops

    def _finish_replay(self) -> list[Op[T]]:
        ops: list[Op[T]] = [EndReplay()]
        held, self._held = self._held, deque()
        self.state = SeqState.IN_SYNC
        for seq, item in held:
            if seq < self.next_seq:
                self.counters.duplicates += 1
                continue
            self._take(seq, item, ops)
        return ops

    def _take(self, seq: int, item: T | None, ops: list[Op[T]]) -> list[Op[T]]:
        """Apply `seq` (>= next_seq): a seq past the expected one, or one without a readable batch, is a hole."""
        if item is None:
            self.counters.lost += 1
        if seq > self.next_seq or item is None:
            self._hole(ops)
        if item is not None:
            ops.append(Apply(seq, item))
        self.next_seq = seq + 1
        return ops

    def _hole(self, ops: list[Op[T]]) -> None:
        self.counters.holes += 1
        self.complete = False
        ops.append(Reset())
