import asyncio
from typing import Any

import pytest

from loadtest.sim import costs
from loadtest.sim.engine import LegKind, Req
from loadtest.sim.handoff import HandoffDesk, HandoffError
from loadtest.sim.link import Fifo
from loadtest.sim.profile import load

QWEN = load("qwen3-32b-h200")


class FakeTime:
    """Virtual clock: sleep advances it instantly (yielding once so other tasks run)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        if s >= 1e6:  # a lease that never runs out within a test
            await asyncio.Event().wait()
        self.now += s
        await asyncio.sleep(0)


def desk(t: FakeTime, released: list[Req]) -> HandoffDesk:
    return HandoffDesk(QWEN, released.append, t.clock, t.sleep, lease_s=1e9)


def test_push_registration_waits_for_prefill_then_writes() -> None:
    t, released = FakeTime(), list[Any]()

    async def go() -> float:
        d = desk(t, released)
        req = Req("r", LegKind.PREFILL, 4096, 1)
        reg = asyncio.ensure_future(d.push("k", "D1", wait_s=10))  # D registers before P's leg arrived
        await asyncio.sleep(0)
        d.on_leg("k", req)
        d.on_prefilled("k")
        took = await reg
        assert released == [req] and d.moved == 1
        return took

    took = asyncio.run(go())
    expect = costs.setup_time(QWEN, 4096) + QWEN.handshake_s + costs.transfer_time(QWEN, 4096)
    assert took == pytest.approx(expect)


def test_link_is_fifo() -> None:
    link = Fifo()
    assert link.reserve(0.0, 2.0) == 2.0
    assert link.reserve(1.0, 2.0) == 4.0  # queued behind the first job
    assert link.reserve(10.0, 1.0) == 11.0  # idle link starts at once
    assert link.busy_s == 5.0


def test_reads_pay_the_handshake_once_per_peer() -> None:
    t, released = FakeTime(), list[Any]()

    async def go() -> list[float]:
        d = desk(t, released)
        took = []
        for k in ("a", "b"):
            d.on_leg(k, Req(k, LegKind.PREFILL, 1024, 1))
            d.on_prefilled(k)
            took.append(await d.read(k, "D1"))
        return took

    first, second = asyncio.run(go())
    x = costs.transfer_time(QWEN, 1024)
    assert first == pytest.approx(QWEN.handshake_s + x)
    assert second == pytest.approx(x)
    assert len(released) == 2


def test_read_of_unknown_or_unfinished_kv_fails_at_once() -> None:
    async def go() -> None:
        d = desk(FakeTime(), [])
        with pytest.raises(HandoffError):
            await d.read("nobody", "D1")
        d.on_leg("k", Req("k", LegKind.PREFILL, 16, 1))
        with pytest.raises(HandoffError):
            await d.read("k", "D1")

    asyncio.run(go())


def test_failed_prefill_leg_fails_the_registration() -> None:
    t = FakeTime()

    async def go() -> None:
        d = desk(t, [])
        reg = asyncio.ensure_future(d.push("k", "D1", wait_s=10))
        await asyncio.sleep(0)
        d.on_leg_failed("k")
        with pytest.raises(HandoffError):
            await reg

    asyncio.run(go())


def test_a_finished_handoff_leaves_no_lease_timer_behind() -> None:
    """Each prefilled handoff starts its lease timer; once the KV has moved (or the leg failed) the timer is
    cancelled, so a busy simulator does not keep one sleeping task per request for the whole lease."""
    t, released = FakeTime(), list[Any]()

    async def go() -> list[asyncio.Task[Any]]:
        d = desk(t, released)
        for i, how in enumerate(("push", "read", "fail")):
            key = f"k{i}"
            d.on_leg(key, Req(f"r{i}", LegKind.PREFILL, 1024, 1))
            d.on_prefilled(key)
            if how == "push":
                await d.push(key, "D1", wait_s=10)
            elif how == "read":
                await d.read(key, "D1")
            else:
                d.on_leg_failed(key)
        await asyncio.sleep(0)  # cancelled timers finish
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(go()) == []
    assert len(released) == 2  # the two that moved; the failed leg's request is the engine's to release


def test_an_unclaimed_handoff_still_expires_after_its_lease() -> None:
    t, released = FakeTime(), list[Any]()

    async def go() -> None:
        d = HandoffDesk(QWEN, released.append, t.clock, t.sleep, lease_s=5.0)
        req = Req("r", LegKind.PREFILL, 1024, 1)
        d.on_leg("k", req)
        d.on_prefilled("k")
        for _ in range(3):
            await asyncio.sleep(0)
        assert released == [req] and t.now == 5.0
        with pytest.raises(HandoffError):
            await d.read("k", "D1")

    asyncio.run(go())
