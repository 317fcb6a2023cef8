"""A lean HTTP/1.1 client for the legs (`LegTransport`): an asyncio.Protocol per connection and httptools'
response parser (this module), a keep-alive pool per origin and the seam, `Http1Legs` (router/legs/http1_pool.py).
A connection knows its pool only as a `ConnectionHome` (four members), so this module imports nothing of the pool.
Only what a leg needs: a POST, its status and headers, its body whole or as it arrives.

- The request is written in one `transport.write` (the request line and Host per URL built once, the rest of the
  head joined once per request); the legs' headers are checked for CR/LF.
- A response's body is buffered up to `high_water` bytes, then the socket stops being read until the consumer
  takes it (`read()` takes it all, so it lifts the bound).
- A connection goes back to the pool only once its response was read to its end on the wire, both sides agreed
  to keep it (no `Connection: close`, HTTP/1.1) and the request was written out whole; a response closed before
  its end, cancelled, failed or dropped aborts its connection, so the worker sees the client leave.
- The pool holds at most `max_connections` connections (busy, idle or connecting, every origin together); an
  idle one of another origin is closed to make room; idle ones are closed after `keepalive` s (under uvicorn's
  5 s, so a pooled connection is never one the worker is closing).

Deadlines: connecting is bounded by `connect_timeout`; nothing else is (a leg's own deadline, in
router/dispatch.py, bounds waiting for a pool slot, the answer and its body). Failures come out as httpx's
exception classes, as every leg transport's do (router/upstream.py maps one family): a connect timeout →
ConnectTimeout, no connection → ConnectError, a connection lost or an answer that is not HTTP/1.1 →
RemoteProtocolError, a header that cannot be sent → LocalProtocolError.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import weakref
from collections.abc import AsyncGenerator, Mapping
from typing import NamedTuple, Protocol, cast

import httptools
import httpx

Origin = tuple[str, str, int]  # scheme, host, port

_MAX_HEAD_BYTES = 2**16  # an answer's header names and values together
_MAX_HEADERS = 256
_LARGE_BODY = 2**16  # above: written without joining it to the head (no copy)
_SKIPPED = frozenset({"host", "content-length", "transfer-encoding", "connection"})  # this client's own


class _HeadTooLarge(Exception):
    pass


class RequestTarget(NamedTuple):
    origin: Origin
    prefix: bytes  # b"POST <path> HTTP/1.1\r\nHost: <host>\r\n"


def target_of(url: str) -> RequestTarget:
    """The origin and the request line of `url`; httpx.UnsupportedProtocol for anything but http(s)://host."""
    parts = httpx.URL(url)
    if parts.scheme not in ("http", "https") or not parts.host:
        raise httpx.UnsupportedProtocol(f"not an http(s) URL with a host: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.host}]" if ":" in parts.host else parts.host
    authority = host if parts.port is None else f"{host}:{port}"
    path = parts.raw_path.decode("ascii") or "/"
    prefix = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii")
    return RequestTarget((parts.scheme, parts.host, port), prefix)


def request_head(prefix: bytes, headers: Mapping[str, str], length: int) -> bytes:
    """The whole request head; a header with CR or LF in it (or not in latin-1) is refused, never sent."""
    lines = [f"{name}: {value}\r\n" for name, value in headers.items() if name.lower() not in _SKIPPED]
    text = "".join(lines)
    if text.count("\r") != len(lines) or text.count("\n") != len(lines):
        raise httpx.LocalProtocolError("a header name or value holds CR or LF")
    try:
        encoded = text.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise httpx.LocalProtocolError(f"a header cannot be sent as latin-1: {exc}") from None
    return b"%s%sContent-Length: %d\r\n\r\n" % (prefix, encoded, length)


class Response:
    """One answer on one connection; the `LegResponse` the legs' callers hold."""

    __slots__ = (
        "__weakref__",  # its connection holds it weakly: a response dropped unclosed aborts the connection
        "_body",
        "_buffered",
        "_conn",
        "_error",
        "_unbounded",
        "_waiter",
        "complete",
        "content_type",
        "head_done",
        "headers",
        "status",
    )

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self.status = 0
        self.content_type = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False  # read to its end on the wire
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: httpx.HTTPError | None = None
        self._unbounded = False
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side
    def feed(self, data: bytes) -> None:
        self._body.append(data)
        self._buffered += len(data)
        conn = self._conn
        if not self._unbounded and conn is not None and self._buffered > conn.high_water:
            conn.pause()
        self.wake()

    def finish(self) -> None:
        self.complete = True
        self.wake()

    def fail(self, error: httpx.HTTPError) -> None:
        if not self.complete and self._error is None:
            self._error = error
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        conn = self._conn
        if conn is None:  # aborted under us: nothing more will come
            raise self._error or httpx.ReadError("the answer was closed")
        waiter = conn.loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    # -- the caller's side
    async def head(self) -> None:
        while not self.head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes:
        """The whole body; the connection is released (or dropped) after."""
        self._unbounded = True
        if self._conn is not None:
            self._conn.resume()
        try:
            while not self.complete:
                if self._error is not None:
                    raise self._error
                await self._wait()
            return b"".join(self._body)
        finally:
            self._body.clear()
            self._close()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives (each chunk: whatever was buffered); at its end the connection is released."""
        while True:
            if self._error is not None:
                raise self._error
            body = self._body
            if body:
                data = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                self._buffered = 0
                if self._conn is not None:
                    self._conn.resume()
                yield data
            elif self.complete:
                self._close()
                return
            else:
                await self._wait()

    async def aclose(self) -> None:
        """Read to its end: back to the pool; else the connection is aborted. Idempotent."""
        self._close()

    def abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self.complete:
            conn.done()
        else:
            conn.abort()

    def __del__(self) -> None:  # dropped without aclose(): never leave its connection waiting
        conn = self._conn
        if conn is not None and not conn.loop.is_closed():
            conn.abort()


class ConnectionHome(Protocol):
    """What a connection needs of the pool that holds it (router/legs/http1_pool.py's ConnectionPool)."""

    loop: asyncio.AbstractEventLoop
    high_water: int  # bytes of a body buffered before the socket stops being read

    def put(self, conn: Connection) -> None:
        """Its answer was read to its end and both sides keep it: idle again."""
        ...

    def forget(self, conn: Connection) -> None:
        """It closed: its place is given back."""
        ...


class Connection(asyncio.Protocol):
    """One keep-alive connection: the protocol, its parser and the answer it is reading (one at a time)."""

    def __init__(self, pool: ConnectionHome, origin: Origin) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.origin = origin
        self.high_water = pool.high_water
        self.transport: asyncio.Transport | None = None
        self._response: weakref.ref[Response] | None = None  # the answer being read (its caller owns it)
        self.closed = False
        self.counted = False  # holds one of the pool's places (from a successful connect until closed)
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._keep_alive = False
        self._interim = False  # a 1xx answer is being parsed: skipped
        self._until_eof = False  # no Content-Length, not chunked: the body ends with the connection
        self._trailing = False  # bytes after the answer's end
        self._head_bytes = 0

    @property
    def response(self) -> Response | None:
        ref = self._response
        return None if ref is None else ref()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:  # nothing was asked: the connection is not HTTP any more
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken(httpx.RemoteProtocolError("the worker switched protocols"))
        except httptools.HttpParserCallbackError as exc:
            self._broken(httpx.RemoteProtocolError(f"unusable answer: {exc.__context__ or exc}"))
        except httptools.HttpParserError as exc:
            self._broken(httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response.complete:
            if response.head_done and self._until_eof and exc is None:
                response.finish()  # the body ran to the end of the connection (never reused)
            elif response.head_done:
                response.fail(httpx.RemoteProtocolError(f"incomplete body: the connection was lost ({exc})"))
            else:
                response.fail(httpx.RemoteProtocolError(f"server disconnected ({exc or 'closed'})"))
        self.pool.forget(self)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        response = self.response
        if response is not None and response.complete:
            self._trailing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        self._head_bytes += len(name) + len(value)
        if response is None or self._head_bytes > _MAX_HEAD_BYTES or len(response.headers) >= _MAX_HEADERS:
            raise _HeadTooLarge(f"more than {_MAX_HEADERS} headers or {_MAX_HEAD_BYTES} bytes of them")
        response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None or response.complete:
            return
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the real answer follows
            self._interim = True
            return
        response.status = status
        framed = False
        for name, value in response.headers:
            key = name.lower()
            if key == b"content-type":
                response.content_type = value.decode("latin-1")
            elif key == b"content-length" or (key == b"transfer-encoding" and b"chunked" in value.lower()):
                framed = True
        self._until_eof = not framed and status not in (204, 304)
        response.head_done = True
        response.wake()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None and not response.complete:
            response.feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or response.complete:
            return
        if self._interim:
            self._interim = False
            response.headers.clear()
            self._head_bytes = 0
            return
        self._keep_alive = self._parser.should_keep_alive() and not self._until_eof
        response.finish()

    # -- the pool's and the response's side
    def send(self, head: bytes, body: bytes) -> Response:
        transport = self.transport
        assert transport is not None and not self.closed
        response = Response(self)
        self._response = weakref.ref(response)
        self._head_bytes = 0
        self._keep_alive = self._interim = self._until_eof = self._trailing = False
        if len(body) <= _LARGE_BODY:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        return response

    def done(self) -> None:
        """Its answer was read to the end: back to the pool if both sides keep it, else closed."""
        transport = self.transport
        self._response = None
        reusable = (
            self._keep_alive
            and not self._trailing
            and not self.closed
            and transport is not None
            and transport.get_write_buffer_size() == 0
        )
        if reusable:
            self.resume()
            self.pool.put(self)
        else:
            self.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection at once (never reused); what it was reading fails."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
        response = self.response
        if response is not None and not response.complete:
            response.fail(httpx.ReadError("the connection was closed"))
        self.pool.forget(self)

    def _broken(self, error: httpx.HTTPError) -> None:
        response = self.response
        if response is not None:
            response.fail(error)
        self.abort()
