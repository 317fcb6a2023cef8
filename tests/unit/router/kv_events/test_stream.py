"""A stream: raw frames through the tracker into the index; the socket work handed back; bad frames counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from router.kv_events.endpoints import RankPublisher
from router.kv_events.index import KvIndex
from router.kv_events.sequence import EndReplay, RequestReplay, SeqCounters
from router.kv_events.stream import FrameCounters, Stream, StreamLimits, StreamStatus, status_of
from router.kv_events.view import KvEventView

BS = 2
TOPIC = b"kv"
END = [b"", b"", b"\xff" * 8, b""]


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def store(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def frame(seq: int, *events: dict[str, Any], rank: int = 0) -> list[bytes]:
    return [TOPIC, seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), rank])]


def replayed(seq: int, *events: dict[str, Any]) -> list[bytes]:
    return [b"", *frame(seq, *events)]


def make(replay: str | None = "tcp://h:2", rank: int = 0, max_frame_bytes: int = 1 << 16) -> tuple[Stream, KvIndex]:
    index = KvIndex(100)
    endpoint = RankPublisher("w", rank, "tcp://h:1", replay, "kv")
    limits = StreamLimits(max_frame_bytes=max_frame_bytes, replay_timeout_s=1.0, max_held=16)
    stream = Stream(endpoint, index.stream("w", rank), Clock(), limits, FrameCounters(), SeqCounters())
    return stream, index


def test_frames_in_order_fill_the_index() -> None:
    stream, index = make()
    assert stream.published(frame(0, store([1], None, [5, 6]))) == []
    assert stream.published(frame(1, store([2], 1, [7, 8]))) == []
    assert index.longest_held_prefix("w", [5, 6, 7, 8, 9]).tokens == 4
    assert stream.tracker.caught_up
    assert status_of(stream) == StreamStatus("w", 0, "in_sync", True, True, 2, 2, 2)
    assert stream.frames.layouts == {"array-batch/map-events": 2}


def test_a_gap_asks_for_a_replay_and_its_answers_fill_the_hole() -> None:
    stream, index = make()
    stream.published(frame(0, store([1], None, [5, 6])))
    assert stream.published(frame(2, store([3], 2, [9, 9]))) == [RequestReplay(1)]
    assert stream.replayed(replayed(1, store([2], 1, [7, 8]))) == []
    assert stream.replayed(replayed(2, store([3], 2, [9, 9]))) == []
    assert stream.replayed(END) == [EndReplay()]
    assert index.longest_held_prefix("w", [5, 6, 7, 8, 9, 9]).blocks == 3
    assert stream.tracker.caught_up and stream.tracker.counters.duplicates == 1


def test_malformed_and_oversized_frames_are_counted_and_cost_a_hole() -> None:
    stream, index = make(replay=None, max_frame_bytes=200)
    stream.published(frame(0, store([1], None, [5, 6])))
    stream.published([TOPIC, (1).to_bytes(8, "big"), b"\xc1"])
    assert index.blocks() == 0 and not stream.tracker.complete
    stream.published(frame(2, store([1], None, list(range(200)))))
    stream.published([TOPIC, b"short", b""])
    stream.replayed([b"x"])
    assert (stream.frames.malformed, stream.frames.oversized) == (3, 1)
    stream.published(frame(3, {"type": "AllBlocksCleared"}, store([1], None, [5, 6])))
    assert stream.tracker.caught_up and index.blocks() == 1  # the engine's cache was cleared: complete again
    assert stream.frames.batches == 2


def test_unknown_events_and_a_rank_mismatch_are_counted() -> None:
    stream, _ = make(rank=1)
    stream.published(frame(0, {"type": "Future"}, rank=0))
    assert (stream.frames.unknown_events, stream.frames.rank_mismatch) == (1, 1)


def test_restart_and_removal_drop_the_index() -> None:
    stream, index = make()
    stream.published(frame(0, store([1], None, [5, 6])))
    stream.published(frame(1, store([2], 1, [7, 8])))
    stream.published(frame(0, store([9], None, [1, 1])))  # the counter went back: a new process
    assert index.longest_held_prefix("w", [5, 6]).blocks == 0
    assert index.longest_held_prefix("w", [1, 1]).blocks == 1
    assert stream.tracker.counters.restarts == 1
    assert stream.published(frame(4, store([2], 1, [7, 8]))) == [RequestReplay(1)]
    assert stream.restarted() == [EndReplay()] and index.blocks() == 0
    assert stream.removed() == [] and stream.tracker.state == "removed"


def test_a_replay_past_its_deadline_ends_on_tick() -> None:
    stream, _ = make()
    stream.published(frame(3))
    assert stream.tick() == []
    stream.tracker.clock.now += 1.0  # type: ignore[attr-defined]
    assert stream.tick() == [EndReplay()]
    assert not stream.tracker.complete


def test_the_view_trusts_a_worker_when_every_rank_is_caught_up() -> None:
    streams = {rank: make(rank=rank)[0] for rank in (0, 1)}
    index = KvIndex(100)
    for rank, stream in streams.items():
        stream.index = index.stream("w", rank)
    view = KvEventView(index, lambda worker: [status_of(s) for s in streams.values()] if worker == "w" else [])
    streams[0].published(frame(0, store([1], None, [5, 6])))
    assert not view.caught_up("w") and view.subscribed("w")
    streams[1].published(frame(0, store([1], None, [5, 6]), store([2], 1, [7, 8]), rank=1))
    assert view.caught_up("w") and not view.caught_up("v") and not view.subscribed("v")
    found = view.held_prefixes([5, 6, 7, 8], ["w", "v"])
    assert (found["w"].tokens, found["w"].rank, found["v"].tokens) == (4, 1, 0)
    assert view.held_prefix("w", [5, 6]).blocks == 1 and len(view.status("w")) == 2
    streams[0].published(frame(1, {**store([3], None, [1, 1]), "session_id": "s"}))
    assert view.session_holders("s") == {"w": 1}


def test_each_live_batchs_lag_and_events_are_counted() -> None:
    index = KvIndex(100)
    endpoint = RankPublisher("w", 0, "tcp://h:1", "tcp://h:2", "kv")
    wall = Clock(1.25)  # the frames are stamped ts=1.0
    frames = FrameCounters()
    stream = Stream(endpoint, index.stream("w", 0), Clock(), StreamLimits(), frames, SeqCounters(), wall=wall)
    stream.published(frame(0, store([1], None, [5, 6]), store([2], 1, [7, 8])))
    wall.now = 2.5
    stream.published(frame(1, store([3], 2, [9, 9])))
    wall.now = 0.5  # the engine's clock ahead of ours: no negative lag
    stream.published(frame(2))
    assert (frames.timed, frames.lag_us_total, frames.lag_us_max, frames.late) == (3, 1_750_000, 1_500_000, 1)
    assert frames.events == 3
    stream.published([TOPIC, (3).to_bytes(8, "big"), b"\xc1"])  # unreadable: not timed
    assert frames.timed == 3
