"""One publisher's frames, through its sequence tracker, into its index. Pure (the subscriber does the I/O).

`Stream` reads the raw multipart messages the subscriber received, runs them through the stream's
`SequenceTracker` and carries out what it decides on the index (`Apply`, `Reset`); what needs sockets
(`RequestReplay`, `EndReplay`) it hands back. A frame that cannot be read is counted (`FrameCounters`) and
skipped; when its seq is known the tracker treats it as a hole. Nothing here raises past the caller. Each live
batch's lag (the engine's stamp, its wall clock when the scheduler step made the batch, to the moment it is read
here, which is when an in-sync stream applies it) is counted: mean, max and how many came later than `LATE_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.kv_events.endpoints import RankPublisher
from router.kv_events.frames import (
    Batch,
    BatchDecoder,
    Cleared,
    FrameError,
    Layout,
    Message,
    ReplayEnd,
    parse_published,
    parse_replayed,
)
from router.kv_events.index import StreamIndex
from router.kv_events.sequence import (
    Apply,
    EndReplay,
    Op,
    RequestReplay,
    Reset,
    SeqCounters,
    SequenceTracker,
)

IoOp = RequestReplay | EndReplay
LATE_S = 1.0  # issue 24: what an engine stores, evicts or clears is in every replica's view within 1 s


@dataclass
class FrameCounters:
    messages: int = 0  # live messages received
    replayed: int = 0  # replay answers received (end markers included)
    batches: int = 0  # batches applied to an index
    malformed: int = 0
    oversized: int = 0
    unknown_events: int = 0  # events of a type we do not know, skipped
    rank_mismatch: int = 0  # batches whose data_parallel_rank is not their endpoint's
    disconnects: int = 0  # publisher connections dropped (the stream started over)
    events: int = 0  # events in the batches applied
    timed: int = 0  # live batches whose lag was taken: the engine's stamp (`ts`, its wall clock) to received here
    lag_us_total: int = 0  # their lags summed, in microseconds (mean: / timed)
    lag_us_max: int = 0
    late: int = 0  # live batches received more than LATE_S after the engine stamped them
    layouts: dict[str, int] = field(default_factory=dict)

    def took(self, lag_s: float) -> None:
        """A live batch arrived `lag_s` after its engine stamped it (clamped at 0: the two clocks may differ)."""
        lag_us = max(0, round(lag_s * 1e6))
        self.timed += 1
        self.lag_us_total += lag_us
        self.lag_us_max = max(self.lag_us_max, lag_us)
        self.late += lag_s > LATE_S


@dataclass(frozen=True)
class StreamLimits:
    max_frame_bytes: int = 4 * 1024 * 1024  # one batch's payload; a prefill step of ~128k tokens is < 1 MiB
    replay_timeout_s: float = 2.0  # one whole replay, request to end marker
    max_held: int = 1024  # live messages held while a replay runs

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 1 or self.replay_timeout_s <= 0 or self.max_held < 1:
            raise ValueError("stream limits must be positive")


@dataclass(frozen=True)
class SubscriberLimits:
    stream: StreamLimits = field(default_factory=StreamLimits)
    rcv_hwm: int = 10_000  # messages queued per socket
    tick_s: float = 0.1  # how often replay deadlines are checked when nothing arrives
    max_drain: int = 256  # messages read from one socket before the task yields

    def __post_init__(self) -> None:
        if self.rcv_hwm < 1 or self.tick_s <= 0 or self.max_drain < 1:
            raise ValueError("subscriber limits must be positive")


class Stream:
    def __init__(
        self,
        endpoint: RankPublisher,
        index: StreamIndex,
        clock: Callable[[], float],
        limits: StreamLimits,
        frames: FrameCounters,
        sequence: SeqCounters,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint = endpoint
        self._wall = wall  # the clock vLLM stamps its batches with (time.time), for their lag
        self.index = index
        self.tracker: SequenceTracker[Batch] = SequenceTracker(
            clock, endpoint.replay is not None, limits.replay_timeout_s, limits.max_held, sequence
        )
        self.frames = frames
        self._decoder = BatchDecoder()
        self._topic = endpoint.topic.encode()
        self._max_bytes = limits.max_frame_bytes

    def published(self, parts: list[bytes]) -> list[IoOp]:
        self.frames.messages += 1
        try:
            message = parse_published(parts, self._decoder, self._topic, self._max_bytes)
        except FrameError as error:
            self._count(error.kind)
            return []
        if message.batch is not None:
            self.frames.took(self._wall() - message.batch.ts)
        return self._run(self.tracker.published(message.seq, self._batch(message)))

    def replayed(self, parts: list[bytes]) -> list[IoOp]:
        self.frames.replayed += 1
        try:
            message = parse_replayed(parts, self._decoder, self._topic, self._max_bytes)
        except FrameError as error:
            self._count(error.kind)
            return []
        if isinstance(message, ReplayEnd):
            return self._run(self.tracker.replay_ended())
        return self._run(self.tracker.replayed(message.seq, self._batch(message)))

    def tick(self) -> list[IoOp]:
        return self._run(self.tracker.tick())

    def restarted(self) -> list[IoOp]:
        return self._run(self.tracker.restarted())

    def removed(self) -> list[IoOp]:
        return self._run(self.tracker.removed())

    def _batch(self, message: Message) -> Batch | None:
        if message.batch is None:
            self._count(message.fault or "malformed")
        return message.batch

    def _count(self, kind: str) -> None:
        if kind == "oversized":
            self.frames.oversized += 1
        else:
            self.frames.malformed += 1

    def _run(self, ops: list[Op[Batch]]) -> list[IoOp]:
        io: list[IoOp] = []
        for op in ops:
            if isinstance(op, Apply):
                self._apply(op.item)
            elif isinstance(op, Reset):
                self.index.drop()
            else:
                io.append(op)
        return io

    def _apply(self, batch: Batch) -> None:
        self.frames.batches += 1
        self.frames.events += len(batch.events)
        self.frames.unknown_events += batch.unknown
        layout: Layout = batch.layout
        self.frames.layouts[layout.value] = self.frames.layouts.get(layout.value, 0) + 1
        if batch.rank is not None and batch.rank != self.endpoint.rank:
            self.frames.rank_mismatch += 1
        self.index.apply(batch.events)
        if any(isinstance(event, Cleared) for event in batch.events):
            self.tracker.cache_cleared()


@dataclass(frozen=True, slots=True)
class StreamStatus:
    worker: str
    rank: int
    state: str  # SeqState's value
    complete: bool
    caught_up: bool
    next_seq: int
    blocks: int  # held in the index
    matchable: int  # of those, the blocks a prompt can match


def status_of(stream: Stream) -> StreamStatus:
    tracker = stream.tracker
    return StreamStatus(
        stream.endpoint.worker,
        stream.endpoint.rank,
        tracker.state.value,
        tracker.complete,
        tracker.caught_up,
        tracker.next_seq,
        len(stream.index),
        stream.index.matchable(),
    )
