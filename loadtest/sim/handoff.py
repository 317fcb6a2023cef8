"""Prefill side of the KV handoff: KV held after prefill until D's push registration or pull read moves it.

A handoff is created by whichever arrives first, P's own leg or D's registration (push sends both legs at
once, so D may register before P has even parsed its request). Writes and reads share one FIFO network link;
push's descriptor setup runs on one writer "thread" (a second FIFO), never on the engine loop. When a push
WRITE leaves is the connector's (`writes.WriteAt`): the server reports P's chunks (`on_chunk`) and step ends
(`on_step_end`); without them (`on_prefilled` only) the whole prompt is written when the prefill is done.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loadtest.sim import costs
from loadtest.sim.engine import Req
from loadtest.sim.link import Fifo
from loadtest.sim.profile import Profile
from loadtest.sim.writes import PlannedWrite, WriteAt, WritePlan, post


class HandoffError(Exception):
    """The handoff cannot happen (unknown key, P leg gone, or its lease ran out)."""


@dataclass(eq=False)
class Handoff:
    key: str
    req: Req | None = None
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)
    written: asyncio.Event = field(default_factory=asyncio.Event)  # the final WRITE landed (or the leg failed)
    claimed: bool = False
    failed: bool = False
    peer: str = ""
    plan: WritePlan | None = None
    expiry: "asyncio.Task[None] | None" = None  # the lease's timer, cancelled once the handoff is done


class HandoffDesk:
    def __init__(
        self,
        profile: Profile,
        release: Callable[[Req], None],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        lease_s: float = 120.0,
        write_at: WriteAt = WriteAt.COMPLETING_STEP,
    ):
        self.profile = profile
        self.write_at = write_at
        self.step_index = 0  # the last P step that ended
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
        h = self._get(key)
        h.req = req
        h.plan = WritePlan(self.write_at, req.prompt)
        if h.claimed:
            self._post(h, h.plan.on_register())

    def on_chunk(self, key: str, computed: int) -> None:
        """P computed a chunk of this leg's prompt in the step now ending (`computed` tokens so far)."""
        h = self._table.get(key)
        if h is not None and h.plan is not None:
            self._post(h, h.plan.on_step_end(self.step_index + 1, computed))

    def on_step_end(self, index: int) -> bool:
        """P's step `index` ended; True when a WRITE waits for one more P step (the caller must run one)."""
        self.step_index = index
        wants = False
        for h in list(self._table.values()):
            if h.plan is not None and not h.plan.finished:
                self._post(h, h.plan.on_step_end(index, h.plan.computed))
                wants = wants or h.plan.wants_step
        return wants

    def on_prefilled(self, key: str) -> None:
        h = self._get(key)
        h.prefilled.set()
        if h.plan is not None:
            self._post(h, h.plan.on_step_end(self.step_index + 1, h.plan.prompt))
        if h.expiry is None and self._table.get(key) is h:
            h.expiry = asyncio.get_running_loop().create_task(self._expire(h))

    def _post(self, h: Handoff, writes: list[PlannedWrite]) -> None:
        if not writes:
            return
        p = self.profile
        done = post(
            writes,
            self._clock(),
            self.writer,
            self.link,
            lambda n: costs.setup_time(p, n),
            lambda n: costs.transfer_time(p, n),
            self._handshake(h.peer),
        )
        if done is not None:
            asyncio.get_running_loop().create_task(self._land(h, done))

    async def _land(self, h: Handoff, done: float) -> None:
        await self._sleep(max(done - self._clock(), 0.0))
        h.written.set()

    def on_leg_failed(self, key: str) -> None:
        h = self._forget(key)
        if h is not None:
            h.failed = True
            h.prefilled.set()  # wakes a waiting registration, which then fails
            h.written.set()

    async def _expire(self, h: Handoff) -> None:
        await self._sleep(self._lease_s)
        h.expiry = None  # this task: done, nothing to cancel
        if not h.claimed and self._table.get(h.key) is h:
            self._finish(h)

    def _finish(self, h: Handoff) -> None:
        if self._table.get(h.key) is h:
            self._forget(h.key)
        if h.req is not None:
            self._release(h.req)

    def _forget(self, key: str) -> Handoff | None:
        """Drops the handoff and cancels its lease timer: one sleeping task per finished handoff would otherwise
        live out the whole lease (120 s), and a zero-cost simulator serving a thousand requests a second then kept
        ~10^5 of them, which all woke 120 s later and took the simulator's core away from the points measured then."""
        h = self._table.pop(key, None)
        if h is not None and h.expiry is not None:
            h.expiry.cancel()
            h.expiry = None
        return h

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
            self._forget(key)
            raise HandoffError(f"no prefill for {key} within {wait_s:.0f}s") from None
        if h.failed or h.req is None:
            raise HandoffError(f"prefill leg for {key} failed")
        return h

    async def push(self, key: str, peer: str, wait_s: float) -> float:
        """D registered its blocks: P WRITEs them when its connector would (write_at), then releases."""
        h = self._get(key)
        if h.claimed:
            raise HandoffError(f"handoff {key} already claimed")
        h.claimed, h.peer = True, peer
        start = self._clock()
        if h.plan is not None:
            self._post(h, h.plan.on_register())
        try:
            await asyncio.wait_for(h.written.wait(), wait_s)
        except TimeoutError:
            self._forget(key)
            raise HandoffError(f"no prefill for {key} within {wait_s:.0f}s") from None
        if h.failed or h.req is None:
            raise HandoffError(f"prefill leg for {key} failed")
        self._finish(h)
        self.moved += 1
        return self._clock() - start

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
