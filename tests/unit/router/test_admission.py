"""Admission: the bound, the short FIFO queue, refusals with Retry-After, hand-over of freed slots."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission
from router.errors import Overloaded
from router.metrics import Metrics


async def hold(admission: Admission, release: asyncio.Event, entered: list[int], tag: int) -> None:
    async with admission.slot():
        entered.append(tag)
        await release.wait()


async def test_requests_beyond_limit_and_queue_are_refused_at_once() -> None:
    admission, release, entered = (
        Admission(limit=2, queue=1, max_wait=30, metrics=Metrics()),
        asyncio.Event(),
        list[int](),
    )
    tasks = [asyncio.create_task(hold(admission, release, entered, i)) for i in range(3)]
    await asyncio.sleep(0)
    assert entered == [0, 1] and admission.in_flight == 2
    with pytest.raises(Overloaded) as info:
        async with admission.slot():
            pass
    assert info.value.http_status == 429 and info.value.retry_after >= 1
    release.set()
    await asyncio.gather(*tasks)
    assert entered == [0, 1, 2] and admission.in_flight == 0


async def test_a_waiter_gives_up_after_max_wait() -> None:
    admission, release = Admission(limit=1, queue=5, max_wait=0.01, metrics=Metrics()), asyncio.Event()
    holder = asyncio.create_task(hold(admission, release, [], 0))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="within"):
        async with admission.slot():
            pass
    release.set()
    await holder
    assert admission.in_flight == 0


async def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    admission, release = Admission(limit=1, queue=5, max_wait=30, metrics=Metrics()), asyncio.Event()
    holder = asyncio.create_task(hold(admission, release, [], 0))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold(admission, asyncio.Event(), [], 1))
    await asyncio.sleep(0)
    waiter.cancel()
    release.set()
    await holder
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.in_flight == 0
    async with admission.slot():
        assert admission.in_flight == 1
