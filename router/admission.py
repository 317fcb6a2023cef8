"""Admission control: a bound on requests in flight with a short, bounded wait queue; beyond it, 429."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.errors import Overloaded
from router.metrics import Metrics


class Admission:
    """At most `limit` requests in flight; up to `queue` more wait (first come, first served) at most
    `max_wait` seconds each. Anything beyond is refused at once with Overloaded (429 + Retry-After).
    Memory stays bounded: the wait queue never holds more than `queue` futures."""

    def __init__(self, limit: int, queue: int, max_wait: float, metrics: Metrics) -> None:
        self.limit, self.queue, self.max_wait = limit, queue, max_wait
        self._metrics = metrics
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """The one way the request path holds a slot: taken on entry (or Overloaded), released on exit."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Takes a slot, waiting in the queue if need be; raises Overloaded. Pair with exactly one release()."""
        if self._in_flight < self.limit and not self._waiters:
            self._enter()
            return
        if len(self._waiters) >= self.queue:
            self._refuse("the router is at its in-flight limit and its wait queue is full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._metrics.queued.set(len(self._waiters))
        try:
            async with asyncio.timeout(self.max_wait):
                await waiter  # _release hands its slot over: _in_flight already counts us
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot was handed over in the very iteration the deadline fired: it is ours
            self._refuse(f"no capacity freed up within {self.max_wait:g} s")
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over as the client left
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self._metrics.queued.set(len(self._waiters))

    def _refuse(self, why: str) -> None:
        self._metrics.rejected.inc()
        raise Overloaded(f"overloaded: {why}; retry shortly", retry_after=max(1, round(self.max_wait)))

    def _enter(self) -> None:
        self._in_flight += 1
        self._metrics.in_flight_total.set(self._in_flight)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the oldest waiter; the count stays
                self._metrics.queued.set(len(self._waiters))
                return
        self._in_flight -= 1
        self._metrics.in_flight_total.set(self._in_flight)
