"""The ZMQ side of KV events: one SUB socket per publisher, a DEALER to its replay socket while a replay runs.

Everything runs on the router's event loop, in one task (`run`): sockets are plain non-blocking pyzmq sockets
whose file descriptors wake the task (`loop.add_reader`); the task drains each socket (at most `max_drain`
messages per turn, then yields), hands the frames to the publisher's `Stream` (router/kv_events/stream.py, pure:
decoding, the sequence, the index) and carries out the socket work it asks for: open a replay and send its
request, or close it. Every `tick_s` the streams' replay deadlines are checked (`Stream.tick`). The index is read
by the deciders on the same loop, so nothing is locked.

Bounds: `rcv_hwm` messages queued per socket (ZMQ drops past it: a gap, then a replay), payloads over
`max_frame_bytes` skipped and counted, a message over four times that refused by ZMQ itself (ZMQ_MAXMSGSIZE: the
connection is dropped and comes back; the loss is a gap), `max_held` live messages held during a replay, every
replay under `replay_timeout_s`, `max_blocks_per_stream` in the index (router/kv_events/index.py).

Workers come and go through `add` (configured, discovered or added by the admin API), `remove` (the stream's
index is dropped, its sockets closed) and `restarted` (the pool saw the worker come back: its index is dropped,
the stream starts over). The SUB socket's monitor reports a dropped connection: the stream starts over too (an
engine that restarted numbers from 0 again, but may be past the last seq seen before its first message arrives;
a network blip that was not a restart costs a replay from 0, and the history if the publisher's replay buffer no
longer reaches back to 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["KvEventSubscriber", "SubscriberLimits"]

from router.kv_events.endpoints import RankPublisher
from router.kv_events.frames import replay_request
from router.kv_events.index import KvIndex
from router.kv_events.sequence import EndReplay, RequestReplay, SeqCounters
from router.kv_events.stream import FrameCounters, IoOp, Stream, StreamStatus, SubscriberLimits, status_of


class _Live:
    """A stream and its sockets: SUB, the SUB's monitor (disconnects), the DEALER of a running replay."""

    __slots__ = ("dealer", "monitor", "stream", "sub")

    def __init__(self, stream: Stream, sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        self.stream = stream
        self.sub = sub
        self.monitor = monitor
        self.dealer: zmq.Socket[bytes] | None = None

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.sub, self.monitor] if self.dealer is None else [self.sub, self.monitor, self.dealer]


class KvEventSubscriber:
    def __init__(
        self,
        index: KvIndex,
        limits: SubscriberLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.limits = limits or SubscriberLimits()
        self.frames = FrameCounters()
        self.sequence = SeqCounters()
        self._clock = clock
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._streams: dict[tuple[str, int], _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = asyncio.Event()
        self._watched: set[int] = set()

    # --- membership -----------------------------------------------------------------------------------------------

    def add(self, endpoints: Iterable[RankPublisher]) -> None:
        """Subscribe to these publishers (idempotent; an endpoint that changed starts its stream over)."""
        for endpoint in endpoints:
            live = self._streams.get(endpoint.key)
            if live is not None:
                if live.stream.endpoint == endpoint:
                    continue
                self._close(endpoint.key)
            self._open(endpoint)

    def remove(self, worker: str) -> None:
        """The worker left: close its streams and forget what it held."""
        for key in [key for key in self._streams if key[0] == worker]:
            self._close(key)
        self.index.drop(worker)

    def restarted(self, worker: str) -> None:
        """The worker came back: what its engine held is gone."""
        for key, live in list(self._streams.items()):
            if key[0] == worker:
                self._execute(live, live.stream.restarted())

    def counters(self) -> dict[str, int]:
        """Every counter and gauge, flat, for /metrics: `frames.*`, `sequence.*`, `index.*`, `layout.<layout>`,
        and the gauges `streams`, `streams_caught_up`, `blocks`."""
        found = {f"frames.{name}": value for name, value in vars(self.frames).items() if isinstance(value, int)}
        found |= {f"layout.{name}": value for name, value in self.frames.layouts.items()}
        found |= {f"sequence.{name}": value for name, value in vars(self.sequence).items()}
        found |= {f"index.{name}": value for name, value in vars(self.index.counters).items()}
        found["streams"] = len(self._streams)
        found["streams_caught_up"] = sum(live.stream.tracker.caught_up for live in self._streams.values())
        found["blocks"] = self.index.blocks()
        return found

    def workers(self) -> list[str]:
        return sorted({worker for worker, _ in self._streams})

    def following(self) -> dict[str, list[RankPublisher]]:
        """Per worker, the endpoints followed now (rank order)."""
        found: dict[str, list[RankPublisher]] = {}
        for key in sorted(self._streams):
            found.setdefault(key[0], []).append(self._streams[key].stream.endpoint)
        return found

    def status(self, worker: str) -> list[StreamStatus]:
        return [status_of(live.stream) for key, live in sorted(self._streams.items()) if key[0] == worker]

    def _open(self, endpoint: RankPublisher) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint.publisher)
        stream = Stream(
            endpoint,
            self.index.stream(endpoint.worker, endpoint.rank),
            self._clock,
            self.limits.stream,
            self.frames,
            self.sequence,
        )
        live = self._streams[endpoint.key] = _Live(stream, sub, monitor)
        self._watch(live.sub)
        self._watch(live.monitor)

    def _close(self, key: tuple[str, int]) -> None:
        live = self._streams.pop(key)
        live.stream.removed()
        self._end_replay(live)
        self._unwatch(live.sub)
        self._unwatch(live.monitor)
        live.sub.disable_monitor()
        live.monitor.close(linger=0)
        live.sub.close(linger=0)
        self.index.drop(key[0], key[1])

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.limits.rcv_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.limits.stream.max_frame_bytes + 1024)
        return sock

    # --- the task -------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read every publisher until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()  # bound to this loop
        for live in self._streams.values():
            for sock in live.sockets():
                self._watch(sock)
        try:
            while True:
                busy = False
                for live in list(self._streams.values()):
                    self._disconnects(live)
                    busy |= self._drain(live, replay=False)
                    busy |= self._drain(live, replay=True)
                    self._execute(live, live.stream.tick())
                if busy:
                    await asyncio.sleep(0)
                    continue
                self._wakeup.clear()
                if self._readable():  # ZMQ's descriptor is edge-triggered: look before sleeping
                    continue
                try:
                    async with asyncio.timeout(self.limits.tick_s):
                        await self._wakeup.wait()
                except TimeoutError:
                    pass
        finally:
            for fd in list(self._watched):
                self._loop.remove_reader(fd)
            self._watched.clear()
            self._loop = None

    def close(self) -> None:
        """Close every socket (after `run` was cancelled)."""
        for key in list(self._streams):
            self._close(key)
        self._context.destroy(linger=0)

    def _drain(self, live: _Live, replay: bool) -> bool:
        """Read what is waiting on one socket; True if more may be."""
        for _ in range(self.limits.max_drain):
            sock = live.dealer if replay else live.sub
            if sock is None:
                return False
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if self._streams.get(live.stream.endpoint.key) is not live:
                return False
            ops = live.stream.replayed(parts) if replay else live.stream.published(parts)
            self._execute(live, ops)
        return True

    def _disconnects(self, live: _Live) -> None:
        """The publisher's connection dropped: its process most likely ended (a restarted engine numbers its
        messages from 0 again, but may be past the last seq seen before anything arrives), so its state goes."""
        while True:
            try:
                event = recv_monitor_message(live.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.frames.disconnects += 1
                self._execute(live, live.stream.restarted())

    def _readable(self) -> bool:
        for live in self._streams.values():
            for sock in live.sockets():
                if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return True
        return False

    def _execute(self, live: _Live, ops: list[IoOp]) -> None:
        for op in ops:
            if isinstance(op, EndReplay):
                self._end_replay(live)
            elif isinstance(op, RequestReplay):
                self._request_replay(live, op.start)

    def _request_replay(self, live: _Live, start: int) -> None:
        self._end_replay(live)
        replay = live.stream.endpoint.replay
        if replay is None:  # the tracker never asks without one
            return
        dealer = self._socket(zmq.DEALER)
        dealer.connect(replay)
        live.dealer = dealer
        self._watch(dealer)
        with contextlib.suppress(zmq.Again):  # nothing to send to yet: the replay's deadline ends it
            dealer.send_multipart(replay_request(start), zmq.NOBLOCK)

    def _end_replay(self, live: _Live) -> None:
        if live.dealer is not None:
            self._unwatch(live.dealer)
            live.dealer.close(linger=0)
            live.dealer = None

    def _watch(self, sock: zmq.Socket[bytes]) -> None:
        if self._loop is None:
            return
        fd = int(sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, self._wakeup.set)
        self._watched.add(fd)
        self._wakeup.set()

    def _unwatch(self, sock: zmq.Socket[bytes]) -> None:
        if self._loop is None:
            return
        fd = int(sock.getsockopt(zmq.FD))
        if fd in self._watched:
            self._loop.remove_reader(fd)
            self._watched.discard(fd)
