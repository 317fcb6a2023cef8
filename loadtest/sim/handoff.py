"""Prefill side of the KV handoff: KV held after prefill until D's push registration or pull read moves it.

A handoff is created by whichever arrives first, P's own leg or D's registration (push sends both legs at
once, so D may register before P has even parsed its request). Writes and reads share one FIFO network link;
push's descriptor setup runs on one writer "thread" (a second FIFO), never on the engine loop.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loadtest.sim import costs
from loadtest.sim.engine import Req
from loadtest.sim.link import Fifo
from loadtest.sim.profile import Profile


class HandoffError(Exception):
    """The handoff cannot happen (unknown key, P leg gone, or its lease ran out)."""


@dataclass(eq=False)
class Handoff:
    key: str
    req: Req | None = None
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False
    failed: bool = False


class HandoffDesk:
    def __init__(
        self,
        profile: Profile,
        release: Callable[[Req], None],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        lease_s: float = 120.0,
    ):
        self.profile = profile
        self.link = Fifo()
        self.writer = Fifo()
        self.moved = 0
        self._release = release
        self._clock = clock
        self._sleep = sleep
        self._lease_s = lease_s
        self._table: dict[str, Handoff] = {}
        self._peers: set[str] = set()

    def _get(self, key: str) -> Handoff:
        h = self._table.get(key)
        if h is None:
            h = self._table[key] = Handoff(key)
        return h

    def on_leg(self, key: str, req: Req) -> None:
        self._get(key).req = req

    def on_prefilled(self, key: str) -> None:
        h = self._get(key)
        h.prefilled.set()
        asyncio.get_running_loop().create_task(self._expire(h))

    def on_leg_failed(self, key: str) -> None:
        h = self._table.pop(key, None)
        if h is not None:
            h.failed = True
            h.prefilled.set()  # wakes a waiting registration, which then fails

    async def _expire(self, h: Handoff) -> None:
        await self._sleep(self._lease_s)
        if not h.claimed and self._table.get(h.key) is h:
            self._finish(h)

    def _finish(self, h: Handoff) -> None:
        self._table.pop(h.key, None)
        if h.req is not None:
            self._release(h.req)

    def _handshake(self, peer: str) -> float:
        if peer in self._peers:
            return 0.0
        self._peers.add(peer)
        return self.profile.handshake_s

    async def _claim(self, key: str, wait_s: float) -> Handoff:
        h = self._get(key)
        if h.claimed:
            raise HandoffError(f"handoff {key} already claimed")
        h.claimed = True
        try:
            if not h.prefilled.is_set():
                await asyncio.wait_for(h.prefilled.wait(), wait_s)
        except TimeoutError:
            self._table.pop(key, None)
            raise HandoffError(f"no prefill for {key} within {wait_s:.0f}s") from None
        if h.failed or h.req is None:
            raise HandoffError(f"prefill leg for {key} failed")
        return h

    async def push(self, key: str, peer: str, wait_s: float) -> float:
        """D registered its blocks: once P's prefill is done, set up on the writer thread, WRITE, release."""
        h = await self._claim(key, wait_s)
        assert h.req is not None
        now = self._clock()
        ready = self.writer.reserve(now, costs.setup_time(self.profile, h.req.prompt))
        done = self.link.reserve(ready, self._handshake(peer) + costs.transfer_time(self.profile, h.req.prompt))
        await self._sleep(max(done - self._clock(), 0.0))
        self._finish(h)
        self.moved += 1
        return done - now

    async def read(self, key: str, peer: str) -> float:
        """D READs (its setup was paid on D's loop): the bytes cross the link, then P frees the blocks.

        A READ only follows P's answer, so an unknown or unfinished handoff fails at once.
        """
        known = self._table.get(key)
        if known is None or not known.prefilled.is_set():
            raise HandoffError(f"no prefilled KV for {key}")
        h = await self._claim(key, 0.0)
        assert h.req is not None
        now = self._clock()
        done = self.link.reserve(now, self._handshake(peer) + costs.transfer_time(self.profile, h.req.prompt))
        await self._sleep(max(done - self._clock(), 0.0))
        self._finish(h)
        self.moved += 1
        return done - now
