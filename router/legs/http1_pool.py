"""The keep-alive pool of router/legs/http1.py's connections and the leg transport over it (`Http1Legs`).

The pool holds at most `limit` connections (busy, idle or connecting, every origin together); an idle one of
another origin is closed to make room; idle ones are closed after `keepalive` s. A place is taken by `acquire`
and given back exactly once, by `forget`, when its connection closes (or at once, when the connect fails).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Mapping

import httpx

from router.legs.http1 import Connection, Origin, RequestTarget, Response, request_head, target_of


class ConnectionPool:
    """The keep-alive connections of one Http1Legs, per origin (newest idle first), at most `limit` in all."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        limit: int,
        connect_timeout: float,
        keepalive: float,
        high_water: int,
    ) -> None:
        self.loop = loop
        self.high_water = high_water
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._idle: dict[Origin, list[Connection]] = {}
        self._all: set[Connection] = set()
        self._open = 0  # connections holding a place: open or being opened
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None

    @property
    def open(self) -> int:
        return self._open

    def idle(self, origin: Origin) -> int:
        return len(self._idle.get(origin, ()))

    async def acquire(self, origin: Origin) -> Connection:
        """An idle connection to `origin`, else a new one once there is room."""
        while True:
            conn = self._take(origin)
            if conn is not None:
                return conn
            if self._open < self._limit:
                break
            if not self._evict(origin):
                await self._wait_for_room()
        self._open += 1
        try:
            conn = await self._connect(origin)
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        conn.counted = True
        self._all.add(conn)
        return conn

    def put(self, conn: Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._keepalive, self._expire)
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """`conn` is closed: its place is free (once)."""
        if not conn.counted:
            return
        conn.counted = False
        self._open -= 1
        self._all.discard(conn)
        stack = self._idle.get(conn.origin)
        if stack is not None and conn in stack:
            stack.remove(conn)
        self._wake_one()

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()

    def _take(self, origin: Origin) -> Connection | None:
        stack = self._idle.get(origin)
        oldest = self.loop.time() - self._keepalive
        while stack:
            conn = stack.pop()
            transport = conn.transport
            if not conn.closed and conn.idle_since > oldest and transport is not None and not transport.is_closing():
                return conn
            conn.abort()
        return None

    def _evict(self, origin: Origin) -> bool:
        """Close the longest idle connection of another origin, to make room; False if there is none."""
        candidates = [(stack[0].idle_since, o) for o, stack in self._idle.items() if stack and o != origin]
        if not candidates:
            return False
        self._idle[min(candidates)[1]][0].abort()
        return True

    def _expire(self) -> None:
        self._sweep = None
        oldest = self.loop.time() - self._keepalive
        for stack in list(self._idle.values()):
            for conn in [c for c in stack if c.idle_since <= oldest]:
                conn.abort()
        if any(self._idle.values()):
            self._sweep = self.loop.call_later(self._keepalive, self._expire)

    async def _wait_for_room(self) -> None:
        waiter = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, then cancelled: pass the turn on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, origin: Origin) -> Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self, origin), host, port, ssl=context, server_hostname=host if context else None
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {self._connect_timeout:g} s") from exc
        except OSError as exc:  # refused, unreachable, no such host, TLS
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        if conn.closed:
            raise httpx.ConnectError(f"{host}:{port} closed the connection at once")
        return conn


class Http1Legs:
    """The leg transport over this module's client: one pool (made in the running loop on first use), sized by
    `max_connections`, idle connections kept `keepalive` s, a body buffered up to `high_water` bytes."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        keepalive: float = 4.0,
        high_water: int = 2**18,
        pool: ConnectionPool | None = None,  # tests: a pool over a fake loop
    ) -> None:
        self._limit = max_connections
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._high_water = high_water
        self._pool: ConnectionPool | None = pool
        self._targets: dict[str, RequestTarget] = {}

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            self._pool = ConnectionPool(
                asyncio.get_running_loop(),
                limit=self._limit,
                connect_timeout=self._connect_timeout,
                keepalive=self._keepalive,
                high_water=self._high_water,
            )
        return self._pool

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Response:
        target = self._targets.get(url)
        if target is None:
            target = target_of(url)
            if len(self._targets) >= 1024:  # worker URLs come and go (discovery): keep the cache bounded
                self._targets.clear()
            self._targets[url] = target
        head = request_head(target.prefix, headers, len(body))
        conn = await self.pool.acquire(target.origin)
        response = conn.send(head, body)
        try:
            await response.head()
        except BaseException:
            response.abort()  # failed, cancelled or given up: the connection is never reused
            raise
        return response

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
