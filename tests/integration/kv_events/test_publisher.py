"""The subscriber against vLLM's own ZMQ publisher (vllm.distributed.kv_events.ZmqEventPublisher, run in this
process): joining late (replay from 0), a gap on the wire (a forwarder in between drops one message: replayed
from the publisher's replay socket), garbage on the wire (counted, skipped), an evicted block, a publisher restart
(its counter goes back: the worker's state is dropped), the worker removed.

The publisher binds its PUB socket on ipc:// (vLLM binds ipc and wildcard tcp only; this keeps to the machine),
its replay ROUTER on loopback tcp; the forwarder subscribes to it and republishes on loopback tcp."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
import zmq

from router.kv_events.endpoints import endpoints_for
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber, SubscriberLimits
from router.kv_events.view import KvEventView
from stack.procs import free_port, port_is_free

kv = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM's publisher")

pytestmark = pytest.mark.vllm
TOPIC = "kv"
BS = 4
PROMPT = list(range(1000, 1024))  # 6 blocks


class Forwarder:
    """SUB from the publisher, PUB to the subscriber, dropping the seqs in `drop` and sending `inject` first."""

    def __init__(self, source: str, port: int) -> None:
        self.drop: set[int] = set()
        self.inject: list[list[bytes]] = []
        self.forwarded = 0
        self._stop = threading.Event()
        self._rebind = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._pub.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, name="forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if self._rebind.is_set():
                self._pub.close(linger=0)
                self._pub = self._context.socket(zmq.PUB)
                self._pub.setsockopt(zmq.LINGER, 0)
                self._bind_again()
                self._rebind.clear()
            while self.inject:
                self._pub.send_multipart(self.inject.pop(0))
            if not poller.poll(20):
                continue
            parts = self._sub.recv_multipart()
            if int.from_bytes(parts[1], "big") in self.drop:
                continue
            self._pub.send_multipart(parts)
            self.forwarded += 1

    def _bind_again(self) -> None:
        """ZMQ unbinds a closed socket in its own I/O thread: retry a moment."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._pub.bind(self.endpoint)
                return
            except zmq.ZMQError as error:
                if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def restart(self) -> None:
        """Close the PUB socket and bind a new one, as a restarted engine does."""
        self._rebind.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._context.destroy(linger=0)


class Publisher:
    """vLLM's publisher and the seq its next batch gets."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self._endpoint, self._replay = endpoint, replay
        self.next_seq = 0
        self.real = self._start()

    def _start(self) -> Any:
        return kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=self._endpoint, replay_endpoint=self._replay, topic=TOPIC, buffer_steps=64
        )

    def publish(self, *events: Any) -> int:
        self.real.publish(kv.KVEventBatch(ts=time.time(), events=list(events)))
        self.next_seq += 1
        return self.next_seq - 1

    def restart(self) -> None:
        """A new publisher on the same endpoints, once the old one's replay port is free (ZMQ unbinds in its own
        I/O thread, after `shutdown` returns)."""
        self.real.shutdown()
        self.next_seq = 0
        host, port = self._replay.removeprefix("tcp://").rsplit(":", 1)
        deadline = time.monotonic() + 10
        while not port_is_free(int(port), host):
            assert time.monotonic() < deadline, "the old publisher's replay port stays bound"
            time.sleep(0.05)
        self.real = self._start()


def stored(first: int, count: int, parent: int | None) -> Any:
    """Blocks first..first+count-1 of PROMPT, hashed by their index + 1 (0 is no hash)."""
    return kv.BlockStored(
        block_hashes=[first + i + 1 for i in range(count)],
        parent_block_hash=parent,
        token_ids=PROMPT[first * BS : (first + count) * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


async def until(predicate: Callable[[], bool], what: str, pump: Callable[[], object] | None = None) -> None:
    """Poll (on the subscriber's loop) until `predicate()`, publishing an empty batch each turn when `pump` is
    given (the PUB socket drops what it sends before a subscription arrives)."""
    deadline = time.monotonic() + 20
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within 20 s")
        if pump is not None:
            pump()
        await asyncio.sleep(0.02)


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Publisher]:
    found = Publisher(f"ipc://{tmp_path}/kv-events", f"tcp://127.0.0.1:{free_port()}")
    yield found
    found.real.shutdown()


@pytest.fixture
def forwarder(publisher: Publisher) -> Iterator[Forwarder]:
    found = Forwarder(publisher.real.get_publisher_config().endpoint, free_port())
    yield found
    found.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_gap_replay_garbage_eviction_restart_and_removal(publisher: Publisher, forwarder: Forwarder, loop: str) -> None:
    """On both event loops the router may run (uvloop is its default)."""
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(subscribed(publisher, forwarder))


async def subscribed(publisher: Publisher, forwarder: Forwarder) -> None:
    subscriber = KvEventSubscriber(KvIndex(1000), SubscriberLimits(tick_s=0.05))
    replay = publisher.real.get_publisher_config().replay_endpoint
    subscriber.add(endpoints_for("w", forwarder.endpoint, replay, TOPIC))
    task = asyncio.create_task(subscriber.run())
    try:
        await scenario(publisher, forwarder, subscriber)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()


async def scenario(publisher: Publisher, forwarder: Forwarder, subscriber: KvEventSubscriber) -> None:
    view = KvEventView(subscriber.index, subscriber.status)

    def held() -> int:
        return view.held_prefix("w", PROMPT).blocks

    # joined late: seq 0 (blocks 0-1) never reaches the subscriber live; the replay from 0 brings it
    forwarder.drop.add(0)
    publisher.publish(stored(0, 2, None))
    await until(lambda: view.caught_up("w"), "caught up after joining late", lambda: publisher.publish())
    assert held() == 2 and subscriber.sequence.replays >= 1

    # a gap on the wire: the forwarder drops block 3's batch; the replay fills it
    forwarder.drop.add(publisher.next_seq + 1)
    publisher.publish(stored(2, 1, 2))
    publisher.publish(stored(3, 1, 3))
    publisher.publish(stored(4, 2, 4))
    await until(lambda: held() == 6, "the dropped batch replayed")
    assert view.caught_up("w") and subscriber.sequence.holes == 0 and subscriber.sequence.gaps >= 1

    # garbage between two good batches is counted and skipped; the gap it leaves in nothing
    forwarder.inject += [[b"kv"], [b"kv", b"\x00\x01", b"x"], [b"kv", b"\xff" * 9, b"", b""]]
    publisher.publish(kv.BlockRemoved(block_hashes=[6], medium="GPU"))  # an evicted block
    await until(lambda: held() == 5, "the eviction seen")
    assert subscriber.frames.malformed == 3 and view.caught_up("w")

    # the engine restarts: its connection drops, its counter starts from 0, what it held is gone
    publisher.restart()
    forwarder.drop.clear()
    forwarder.restart()
    publisher.publish(stored(0, 1, None))
    await until(lambda: held() == 1 and view.caught_up("w"), "the restart seen", publisher.publish)
    assert subscriber.frames.disconnects >= 1 and subscriber.sequence.restarts >= 1

    subscriber.remove("w")
    assert not view.subscribed("w") and subscriber.index.blocks() == 0 and held() == 0
