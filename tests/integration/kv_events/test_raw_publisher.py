"""The subscriber against hand-driven ZMQ publishers speaking vLLM's wire protocol in the other layouts (map
batches, no topic frame on replay), with what vLLM's own publisher never does on purpose: a replay socket that
never answers (the replay's deadline ends it: a hole), oversized and malformed frames, two DP ranks on port
offsets, endpoints that change, a worker restarted by the pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq

from router.kv_events.endpoints import RankPublisher, endpoints_for
from router.kv_events.index import KvIndex
from router.kv_events.stream import StreamLimits
from router.kv_events.subscriber import KvEventSubscriber, SubscriberLimits
from router.kv_events.view import KvEventView
from stack.procs import free_port, port_is_free

pytestmark = pytest.mark.integration
BS = 2
TOPIC = b"kv"


def store(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }


class RawPublisher:
    """A PUB socket (and optionally a ROUTER that reads replay requests and never answers)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.seq = 0

    def send(self, *events: dict[str, Any], payload: bytes | None = None) -> None:
        body = payload if payload is not None else msgspec.msgpack.encode({"ts": 1.0, "events": list(events)})
        self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), body])
        self.seq += 1


async def until(predicate: Callable[[], bool], what: str, pump: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within 20 s")
        if pump is not None:
            pump()
        await asyncio.sleep(0.02)


@pytest.fixture
async def context() -> AsyncIterator[zmq.Context[zmq.Socket[bytes]]]:
    found: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield found
    found.destroy(linger=0)


@pytest.fixture
async def subscriber() -> AsyncIterator[KvEventSubscriber]:
    limits = SubscriberLimits(stream=StreamLimits(max_frame_bytes=2048, replay_timeout_s=0.3), tick_s=0.05)
    found = KvEventSubscriber(KvIndex(1000), limits)
    task = asyncio.create_task(found.run())
    yield found
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    found.close()


async def test_two_ranks_a_silent_replay_socket_and_bad_frames(
    context: zmq.Context[zmq.Socket[bytes]], subscriber: KvEventSubscriber
) -> None:
    base = free_port()
    while not port_is_free(base + 1):  # rank 1 publishes on base + 1
        base = free_port()
    ranks = [RawPublisher(context, base), RawPublisher(context, base + 1)]
    silent = context.socket(zmq.ROUTER)  # takes replay requests, answers none
    silent.setsockopt(zmq.LINGER, 0)
    replay_port = silent.bind_to_random_port("tcp://127.0.0.1")
    view = KvEventView(subscriber.index, subscriber.status)
    endpoints = endpoints_for("w", f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{replay_port}", "kv", dp_size=2)
    assert endpoints[1].publisher.endswith(f":{base + 1}")
    subscriber.add(endpoints)
    subscriber.add(endpoints)  # the same again: nothing changes

    def pump() -> None:
        for rank in ranks:
            rank.send()

    # rank 1 holds three blocks, rank 0 one; both start at seq 0 once the subscription is there
    await until(lambda: all(s.state == "in_sync" for s in view.status("w")), "both ranks heard", pump)
    ranks[0].send(store([1], None, [5, 6]))
    ranks[1].send(store([1, 2, 3], None, [5, 6, 7, 8, 9, 9]))
    await until(lambda: view.held_prefix("w", [5, 6, 7, 8, 9, 9]).blocks == 3, "rank 1's blocks")
    assert view.held_prefix("w", [5, 6, 7, 8]).rank == 1
    assert subscriber.frames.layouts == {"map-batch/map-events": subscriber.frames.batches}
    counters = subscriber.counters()
    assert counters["streams"] == 2 and counters["blocks"] == 4 and counters["index.stored"] == 4
    assert counters["layout.map-batch/map-events"] == counters["frames.batches"] > 0

    # a gap on rank 0: the replay socket never answers; at the deadline the gap is a hole and the index resets
    while silent.poll(0):  # the join's replay requests (the first seq seen may not have been 0)
        silent.recv_multipart()
    timeouts, holes = subscriber.sequence.replay_timeouts, subscriber.sequence.holes
    missing = ranks[0].seq
    ranks[0].seq += 1
    ranks[0].send(store([7], None, [1, 1]))
    await until(lambda: subscriber.sequence.replay_timeouts == timeouts + 1, "the replay given up")
    assert silent.poll(1000) and silent.recv_multipart()[1:] == [b"", missing.to_bytes(8, "big")]
    rank0 = view.status("w")[0]
    assert rank0.state == "in_sync" and not rank0.complete and rank0.blocks == 1  # only what came after the hole
    assert not view.caught_up("w") and subscriber.sequence.holes == holes + 1

    # oversized and malformed payloads on rank 1: counted, skipped (each a hole: its seq is known)
    ranks[1].send(store([9], None, list(range(2000))))
    ranks[1].send(payload=b"\xc1")
    await until(lambda: subscriber.frames.oversized == 1 and subscriber.frames.malformed == 1, "bad frames counted")

    # the pool says the worker restarted: both ranks start over
    subscriber.restarted("w")
    assert subscriber.index.blocks("w") == 0 and [s.state for s in view.status("w")] == ["fresh", "fresh"]

    # rank 1's endpoint changes: that stream starts over, rank 0's stays
    moved = RawPublisher(context, free_port())
    subscriber.add([endpoints[0], RankPublisher("w", 1, moved.pub.getsockopt_string(zmq.LAST_ENDPOINT), None, "kv")])
    await until(lambda: view.status("w")[1].state == "in_sync", "the moved rank heard", moved.send)
    subscriber.remove("w")
    assert view.status("w") == [] and subscriber.workers() == [] and subscriber.index.blocks() == 0
    for sock in (*[r.pub for r in ranks], moved.pub, silent):
        sock.close(linger=0)
