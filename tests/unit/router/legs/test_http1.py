"""router/legs/http1.py and router/legs/http1_pool.py without sockets: the protocol driven through a fake transport, the
pool over a fake loop (its create_connection hands out fake transports). Parsing split at every byte, keep-alive
reuse rules, pool limits, aborts on cancel, close or drop, and every failure as the httpx class
router/upstream.py maps."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import httpx
import pytest

from router.domain import Role
from router.errors import UpstreamConnectError, UpstreamTimeout
from router.legs.http1 import Connection, Response, request_head, target_of
from router.legs.http1_pool import ConnectionPool, Http1Legs
from router.upstream import translate

URL = "http://w:8100/v1/completions"
HEADERS = {"content-type": "application/json", "x-request-id": "r-1"}
JSON = b'{"ok": true}'
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n" + JSON
EVENTS = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS)
    + b"0\r\n\r\n"
)


class FakeTransport:
    """What Connection uses of an asyncio transport; closing it reports the loss on the next loop turn."""

    def __init__(self, protocol: Connection) -> None:
        self.protocol = protocol
        self._loop = asyncio.get_running_loop()
        self.written = bytearray()
        self.writes = 0
        self.buffered = 0  # what the kernel has not taken yet
        self.paused = False
        self.aborted = False
        self.closed = False
        self.eof = False  # the worker closed its side; the loss is not reported yet

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes += 1

    def writelines(self, parts: Iterable[bytes]) -> None:
        for part in parts:
            self.written += part
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closed or self.eof

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True
        self._lost()

    def close(self) -> None:
        self._lost()

    def _lost(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.call_soon(self.protocol.connection_lost, None)

    def answer(self, data: bytes) -> None:
        self.protocol.data_received(data)


class FakeLoop:
    """The running loop, except the clock (set by the test) and create_connection (fake transports)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.now = 1000.0
        self.transports: list[FakeTransport] = []
        self.refuse = False
        self.hang = False

    def time(self) -> float:
        return self.now

    def is_closed(self) -> bool:
        return self._loop.is_closed()

    def create_future(self) -> asyncio.Future[None]:
        return self._loop.create_future()

    def call_later(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay, callback)

    async def create_connection(
        self, factory: Callable[[], Connection], host: str, port: int, **_: Any
    ) -> tuple[FakeTransport, Connection]:
        if self.refuse:
            raise ConnectionRefusedError(111, "Connection refused")
        if self.hang:
            await asyncio.Event().wait()
        protocol = factory()
        transport = FakeTransport(protocol)
        protocol.connection_made(cast(asyncio.Transport, transport))
        self.transports.append(transport)
        return transport, protocol


def make(limit: int = 4, *, keepalive: float = 4.0, high_water: int = 64) -> tuple[Http1Legs, ConnectionPool, FakeLoop]:
    loop = FakeLoop()
    pool = ConnectionPool(
        cast(asyncio.AbstractEventLoop, loop),
        limit=limit,
        connect_timeout=0.05,
        keepalive=keepalive,
        high_water=high_water,
    )
    return Http1Legs(max_connections=limit, connect_timeout=0.05, pool=pool), pool, loop


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def posted(legs: Http1Legs, loop: FakeLoop, url: str = URL, body: bytes = b"{}") -> asyncio.Task[Response]:
    """A post in flight whose request has been written (its transport is loop.transports[-1])."""
    task = asyncio.create_task(legs.post(url, body, HEADERS))
    await turns()
    return task


async def exchange(legs: Http1Legs, loop: FakeLoop, answer: bytes, url: str = URL) -> Response:
    """A post whose connection (the newest written to) answers `answer`."""
    task = await posted(legs, loop, url)
    busy = [t for t in loop.transports if t.protocol.response is not None and not t.closed]
    busy[-1].answer(answer)
    return await task


def splits(raw: bytes) -> Iterable[list[bytes]]:
    """`raw` cut in two at every byte, then byte by byte."""
    for i in range(1, len(raw)):
        yield [raw[:i], raw[i:]]
    yield [raw[i : i + 1] for i in range(len(raw))]


async def test_the_request_is_one_write_with_its_head_built_once() -> None:
    legs, _, loop = make()
    task = await posted(legs, loop, body=JSON)
    transport = loop.transports[0]
    assert transport.writes == 1
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    assert head.split(b"\r\n") == [
        b"POST /v1/completions HTTP/1.1",
        b"Host: w:8100",
        b"content-type: application/json",
        b"x-request-id: r-1",
        b"Content-Length: 12",
    ]
    assert body == JSON
    transport.answer(WHOLE)
    assert await (await task).read() == JSON


def test_targets_and_heads() -> None:
    assert target_of("http://[::1]:8080/v1/x?a=1").prefix == b"POST /v1/x?a=1 HTTP/1.1\r\nHost: [::1]:8080\r\n"
    assert target_of("https://w/v1/x").origin == ("https", "w", 443)
    with pytest.raises(httpx.UnsupportedProtocol):
        target_of("ftp://w/x")
    own = {"Host": "evil", "Content-Length": "1", "Transfer-Encoding": "chunked", "Connection": "close", "a": "b"}
    assert request_head(b"P\r\n", own, 3) == b"P\r\na: b\r\nContent-Length: 3\r\n\r\n"
    for bad in ({"a": "b\r\nx: y"}, {"a\nb": "c"}, {"a": "b\rc"}, {"a": "\u20ac"}):
        with pytest.raises(httpx.LocalProtocolError):
            request_head(b"P\r\n", bad, 0)


@pytest.mark.parametrize("parts", list(splits(CHUNKED)), ids=lambda p: str(len(p[0])))
async def test_a_chunked_stream_split_anywhere_gives_the_same_body(parts: list[bytes]) -> None:
    legs, pool, loop = make(high_water=2**20)
    task = await posted(legs, loop)
    transport = loop.transports[0]
    for part in parts:
        transport.answer(part)
    response = await task
    assert (response.status, response.content_type) == (200, "text/event-stream")
    assert b"".join([chunk async for chunk in response.chunks()]) == b"".join(EVENTS)
    assert pool.idle(("http", "w", 8100)) == 1 and not transport.aborted  # read to its end: pooled


@pytest.mark.parametrize("parts", list(splits(WHOLE)), ids=lambda p: str(len(p[0])))
async def test_a_content_length_answer_split_anywhere_is_read_whole(parts: list[bytes]) -> None:
    legs, pool, loop = make()
    task = await posted(legs, loop)
    for part in parts:
        loop.transports[0].answer(part)
    response = await task
    assert response.status == 200 and await response.read() == JSON
    assert pool.idle(("http", "w", 8100)) == 1


async def test_an_answer_read_to_its_end_is_reused_and_interim_answers_are_skipped() -> None:
    legs, pool, loop = make()
    for _ in range(3):
        response = await exchange(legs, loop, b"HTTP/1.1 100 Continue\r\n\r\n" + WHOLE)
        assert response.status == 200 and await response.read() == JSON
    assert len(loop.transports) == 1 and pool.open == 1
    assert bytes(loop.transports[0].written).count(b"POST ") == 3


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 12\r\n\r\n" + JSON,
        b"HTTP/1.0 200 OK\r\nContent-Length: 12\r\n\r\n" + JSON,
        WHOLE + b"HTTP/1.1 200 OK\r\n",  # bytes after the answer: the connection is out of step
    ],
    ids=["connection-close", "http-1.0", "trailing-bytes"],
)
async def test_connections_the_worker_does_not_keep_are_not_reused(answer: bytes) -> None:
    legs, pool, loop = make()
    response = await exchange(legs, loop, answer)
    assert await response.read() == JSON
    assert loop.transports[0].closed and pool.open == 0 and pool.idle(("http", "w", 8100)) == 0
    second = await exchange(legs, loop, WHOLE)
    assert await second.read() == JSON and len(loop.transports) == 2


async def test_a_request_not_yet_written_out_keeps_its_connection_from_the_pool() -> None:
    legs, pool, loop = make()
    task = await posted(legs, loop)
    loop.transports[0].buffered = 10  # a worker that answered before reading the whole body
    loop.transports[0].answer(WHOLE)
    assert await (await task).read() == JSON
    assert loop.transports[0].closed and pool.open == 0


async def test_a_body_that_runs_to_the_end_of_the_connection() -> None:
    legs, pool, loop = make()
    response = await exchange(legs, loop, b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nabc")
    loop.transports[0].protocol.connection_lost(None)
    assert await response.read() == b"abc" and pool.open == 0


async def test_closing_an_answer_before_its_end_aborts_its_connection() -> None:
    legs, pool, loop = make()
    response = await exchange(legs, loop, CHUNKED[:-20])
    chunks = response.chunks()
    assert (await anext(chunks)).startswith(b"data: 1")
    await chunks.aclose()
    await response.aclose()
    await response.aclose()  # idempotent
    assert loop.transports[0].aborted and pool.open == 0
    await turns()
    assert pool.open == 0  # the loss that follows frees nothing twice


async def test_a_post_cancelled_before_the_answer_aborts_its_connection() -> None:
    legs, pool, loop = make()
    task = await posted(legs, loop)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop.transports[0].aborted and pool.open == 0
    loop.transports[0].answer(WHOLE)  # a late answer on the dead connection changes nothing
    assert pool.idle(("http", "w", 8100)) == 0


async def test_a_read_cancelled_midway_and_a_dropped_answer_abort_their_connections() -> None:
    legs, pool, loop = make()
    response = await exchange(legs, loop, WHOLE[:-4])
    reading = asyncio.create_task(response.read())
    await turns()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert loop.transports[0].aborted
    dropped = await exchange(legs, loop, WHOLE[:-4])
    del dropped
    await turns()  # the finished post's task lets go of its result
    gc.collect()
    assert loop.transports[1].aborted and pool.open == 0


async def test_a_slow_reader_pauses_the_socket_and_resumes_it_once_it_caught_up() -> None:
    legs, _, loop = make(high_water=16)
    response = await exchange(legs, loop, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    transport = loop.transports[0]
    transport.answer(b"x" * 10)
    assert not transport.paused
    transport.answer(b"y" * 10)
    assert transport.paused
    chunks = response.chunks()
    assert await anext(chunks) == b"x" * 10 + b"y" * 10
    assert not transport.paused
    transport.answer(b"z" * 40)
    assert transport.paused
    whole = asyncio.create_task(response.read())  # wants it all: no bound any more
    await turns()
    assert not transport.paused
    whole.cancel()
    await chunks.aclose()


async def test_the_pool_limit_holds_and_a_freed_place_goes_to_the_waiter() -> None:
    legs, pool, loop = make(limit=2)
    first, second = await posted(legs, loop), await posted(legs, loop)
    third = await posted(legs, loop)
    assert len(loop.transports) == 2 and not third.done()
    loop.transports[0].answer(WHOLE)
    assert await (await first).read() == JSON  # back to the pool: the waiter takes it
    await turns()
    assert len(loop.transports) == 2 and bytes(loop.transports[0].written).count(b"POST ") == 2
    loop.transports[1].answer(b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n")
    assert (await second).status == 500
    loop.transports[0].answer(WHOLE)
    assert await (await third).read() == JSON and pool.open <= 2


async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    legs, pool, loop = make(limit=1)
    first = await posted(legs, loop)
    waiting, after = await posted(legs, loop), await posted(legs, loop)
    loop.transports[0].answer(WHOLE)
    response = await first
    await response.read()  # wakes `waiting` ...
    waiting.cancel()  # ... which is cancelled before it runs
    await turns()
    assert waiting.cancelled() and len(loop.transports) == 1
    loop.transports[0].answer(WHOLE)
    async with asyncio.timeout(5):  # hang guard: a turn that is not passed on leaves `after` waiting forever
        assert await (await after).read() == JSON and pool.open == 1


async def test_a_full_pool_closes_another_origins_idle_connection_to_make_room() -> None:
    legs, pool, loop = make(limit=1)
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    other = await exchange(legs, loop, WHOLE, url="http://v:8200/v1/completions")
    assert loop.transports[0].closed and await other.read() == JSON
    assert pool.open == 1 and pool.idle(("http", "v", 8200)) == 1


async def test_idle_connections_expire_after_keepalive() -> None:
    legs, pool, loop = make(keepalive=4.0)
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    loop.now += 4.5
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    assert loop.transports[0].closed and len(loop.transports) == 2 and pool.open == 1
    loop.transports[1].eof = True  # the worker closed its side of the idle one: never reused ...
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    assert len(loop.transports) == 3 and pool.open == 1
    loop.transports[2].protocol.connection_lost(None)  # ... and one whose loss is reported leaves the pool
    assert pool.open == 0 and pool.idle(("http", "w", 8100)) == 0
    await legs.aclose()


async def upstream_error(call: Callable[[], Awaitable[object]]) -> type[Exception]:
    with pytest.raises(httpx.HTTPError) as caught:
        await call()
    return type(translate(caught.value, leg=Role.DECODE, worker="w"))


async def test_connect_failures_are_the_httpx_errors_the_callers_map() -> None:
    legs, pool, loop = make()
    loop.refuse = True
    with pytest.raises(httpx.ConnectError, match="refused"):
        await legs.post(URL, b"{}", HEADERS)
    assert await upstream_error(lambda: legs.post(URL, b"{}", HEADERS)) is UpstreamConnectError
    loop.refuse, loop.hang = False, True
    with pytest.raises(httpx.ConnectTimeout):
        await legs.post(URL, b"{}", HEADERS)
    assert await upstream_error(lambda: legs.post(URL, b"{}", HEADERS)) is UpstreamTimeout
    assert pool.open == 0
    with pytest.raises(httpx.LocalProtocolError):
        await legs.post(URL, b"{}", {"x": "a\r\nb"})
    assert pool.open == 0


@pytest.mark.parametrize(
    ("answer", "lost", "match"),
    [
        (b"", True, "server disconnected"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nabc", True, "incomplete body"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", True, "incomplete body"),
        (b"NOT HTTP\r\n\r\n", False, "not an HTTP/1.1 answer"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n", False, "switched"),
        (b"HTTP/1.1 200 OK\r\n" + b"a: b\r\n" * 300 + b"\r\n", False, "more than 256 headers"),
    ],
    ids=["lost-before-head", "short-length", "short-chunk", "garbage", "upgrade", "too-many-headers"],
)
async def test_broken_answers_fail_their_leg_and_their_connection(answer: bytes, lost: bool, match: str) -> None:
    legs, pool, loop = make()
    task = await posted(legs, loop)
    transport = loop.transports[0]

    async def whole() -> bytes:
        transport.answer(answer)
        if lost:
            transport.protocol.connection_lost(None)
        return await (await task).read()

    with pytest.raises(httpx.RemoteProtocolError, match=match) as caught:
        await whole()
    assert type(translate(caught.value, leg=Role.DECODE, worker="w")) is UpstreamConnectError
    await turns()
    assert pool.open == 0 and pool.idle(("http", "w", 8100)) == 0


async def test_bytes_on_an_idle_connection_drop_it() -> None:
    legs, pool, loop = make()
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    loop.transports[0].answer(b"HTTP/1.1 200 OK\r\n")
    assert loop.transports[0].aborted and pool.open == 0 and pool.idle(("http", "w", 8100)) == 0


async def test_closing_the_legs_aborts_busy_and_idle_connections() -> None:
    legs, pool, loop = make()
    assert await (await exchange(legs, loop, WHOLE)).read() == JSON
    busy = await posted(legs, loop, url="http://v:8200/v1/completions")
    await legs.aclose()
    assert all(t.aborted for t in loop.transports) and pool.open == 0
    with pytest.raises(httpx.HTTPError):
        await busy
