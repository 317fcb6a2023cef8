"""The background-loop supervisor: restarts with a doubling backoff, reports every error, gives up, stops."""

from __future__ import annotations

import asyncio

import pytest

from router.loops import LoopEnded, Restarts, Supervisor


class Recorder:
    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []
        self.delays: list[float] = []
        self.now = 0.0

    def on_error(self, name: str, exc: BaseException) -> None:
        self.errors.append((name, type(exc).__name__))

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)

    def clock(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(200):  # enough turns of the event loop for every restart the tests script
        await asyncio.sleep(0)


async def test_a_failing_loop_is_restarted_with_a_doubling_backoff_and_every_error_is_reported() -> None:
    rec = Recorder()
    runs: list[int] = []
    parked = asyncio.Event()

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) <= 4:
            raise ValueError("not an httpx error")
        parked.set()
        await asyncio.get_running_loop().create_future()  # the fifth run works: runs until cancelled

    sup = Supervisor(rec.on_error, restarts=Restarts(backoff=0.5, backoff_max=2.0), sleep=rec.sleep, clock=rec.clock)
    sup.spawn("health", loop)
    await asyncio.wait_for(parked.wait(), 5.0)
    assert rec.errors == [("health", "ValueError")] * 4
    assert rec.delays == [0.5, 1.0, 2.0, 2.0]
    assert sup.alive()
    await sup.stop()
    assert rec.errors == [("health", "ValueError")] * 4, "cancellation at stop is not an error"
    assert sup.alive()


async def test_a_loop_that_keeps_failing_is_dead_after_its_budget() -> None:
    rec = Recorder()

    async def broken() -> None:
        raise KeyError("boom")

    async def fine() -> None:
        await asyncio.get_running_loop().create_future()

    sup = Supervisor(rec.on_error, restarts=Restarts(budget=3), sleep=rec.sleep, clock=rec.clock)
    sup.spawn("scrape", broken)
    sup.spawn("health", fine)
    await settle()
    assert rec.errors == [("scrape", "KeyError")] * 3 and len(rec.delays) == 2
    assert not sup.alive() and sup.dead == ("scrape",)
    await sup.stop()


async def test_a_loop_that_returns_is_dead_at_once() -> None:
    rec = Recorder()

    async def returns() -> None:
        return None

    sup = Supervisor(rec.on_error, sleep=rec.sleep, clock=rec.clock)
    sup.spawn("discovery decode", returns)
    await settle()
    assert rec.errors == [("discovery decode", LoopEnded.__name__)]
    assert not sup.alive() and rec.delays == []
    await sup.stop()


async def test_a_long_healthy_run_resets_the_failure_streak() -> None:
    rec = Recorder()
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            rec.now += 61.0  # this run lasted past healthy_after before it failed
        if runs <= 4:
            raise RuntimeError(f"failure {runs}")
        await asyncio.get_running_loop().create_future()

    sup = Supervisor(
        rec.on_error, restarts=Restarts(backoff=1.0, budget=3, healthy_after=60.0), sleep=rec.sleep, clock=rec.clock
    )
    sup.spawn("health", flaky)
    await settle()
    assert sup.alive(), "runs 1-2, then 3-4: never three failures in a row within a streak"
    assert rec.delays == [1.0, 2.0, 1.0, 2.0]
    await sup.stop()


async def test_a_broken_error_hook_does_not_stop_the_restarts() -> None:
    rec = Recorder()
    runs = 0

    def hook(name: str, exc: BaseException) -> None:
        raise RuntimeError("the metrics registry is gone")

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise ValueError("once")
        await asyncio.get_running_loop().create_future()

    sup = Supervisor(hook, sleep=rec.sleep, clock=rec.clock)
    sup.spawn("health", loop)
    await settle()
    assert runs == 2 and sup.alive()
    await sup.stop()


async def test_names_are_unique_and_nothing_starts_after_stop() -> None:
    rec = Recorder()

    async def idle() -> None:
        await asyncio.get_running_loop().create_future()

    sup = Supervisor(rec.on_error, sleep=rec.sleep)
    sup.spawn("health", idle)
    with pytest.raises(ValueError, match="already running"):
        sup.spawn("health", idle)
    await sup.stop()
    with pytest.raises(RuntimeError, match="after stop"):
        sup.spawn("scrape", idle)
