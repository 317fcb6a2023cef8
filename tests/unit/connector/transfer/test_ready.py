"""The ready seam (``connector.transfer.ready``): a WRITE ordered from ``wait_for_save`` is posted only after the
step's event completed, in submission order; the owner thread binds the device before any backend call."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from connector.rendezvous.actions import Tally
from connector.transfer.memory import MemoryBackend, MemoryFabric
from connector.transfer.ready import READY, CudaFence, HostFence, ReadyEvent, fence_for
from connector.wire.plan import PrefillFinished, StepPlan
from connector.worker import WorkerHalf
from tests.unit.connector.test_transfer_thread import Side, make_side, register, sha, wait_for


class FakeEvent:
    """A CUDA event stand-in: not complete until the test says so; counts the owner thread's queries."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class FakeFence:
    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.bound: set[int] = set()

    def record(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def bind_thread(self) -> None:
        self.bound.add(threading.get_ident())


@pytest.fixture
def gated() -> Iterator[tuple[Side, Side, FakeFence]]:
    fabric, fence = MemoryFabric(), FakeFence()
    p, d = make_side(fabric, "P", seed=1, fence=fence), make_side(fabric, "D", seed=None)
    yield p, d, fence
    d.thread.close()
    p.thread.close()


def test_a_write_ordered_from_wait_for_save_waits_for_the_step_event(gated: tuple[Side, Side, FakeFence]) -> None:
    p, d, fence = gated
    register(p, d)
    register(p, d, req="d2", key="t:2", blocks=(3,))
    wait_for(lambda: p.thread._prefill.live == 2)  # both registrations wait at P: a ready prefill WRITEs at once
    event = fence.record()
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)), event)
    p.thread.submit(PrefillFinished("p2", "t:2", (4,)))  # ready itself, but submitted after: stays behind
    wait_for(lambda: event.queries >= 5)  # the owner thread looked at the event five times...
    assert p.collect().counters[Tally.WRITES_POSTED] == 0, "...and posted nothing before it completed"
    assert d.block(5) == bytes(len(d.block(5))) and not d.collect().received
    event.done = True
    wait_for(lambda: {"d1", "d2"} <= d.collect().received)
    assert sha(d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2)) and d.block(3) == p.block(4)
    assert p.collect().counters[Tally.WRITES_POSTED] == 2 and not d.results.failed


class _ThreadCheckedBackend(MemoryBackend):
    """Fails a test (through ``calls``) when a backend call comes from a thread the fence has not bound."""

    fence: FakeFence
    calls: list[bool]

    def poll_notices(self) -> list[tuple[str, bytes]]:
        self.calls.append(threading.get_ident() in self.fence.bound)
        return super().poll_notices()


def test_the_owner_thread_binds_the_device_before_any_backend_call() -> None:
    fence = FakeFence()
    _ThreadCheckedBackend.fence, _ThreadCheckedBackend.calls = fence, []
    side = make_side(MemoryFabric(), "P", seed=1, fence=fence, backend_cls=_ThreadCheckedBackend)
    try:
        side.thread.kick()
        wait_for(lambda: len(_ThreadCheckedBackend.calls) >= 2)
    finally:
        side.thread.close()
    assert all(_ThreadCheckedBackend.calls) and len(fence.bound) == 1


def test_the_cuda_fence_is_chosen_for_vram_only() -> None:
    vram = fence_for("VRAM", 3)
    assert isinstance(vram, CudaFence) and vram.device_id == 3
    assert isinstance(fence_for("DRAM", 0), HostFence)
    assert HostFence().record() is READY and READY.query()


class _Recorder:
    def __init__(self) -> None:
        self.submitted: list[tuple[object, ReadyEvent]] = []

    def submit(self, order: object, ready: ReadyEvent = READY) -> None:
        self.submitted.append((order, ready))


def test_wait_for_save_records_one_event_per_step_and_hands_it_with_the_steps_orders() -> None:
    worker = WorkerHalf.__new__(WorkerHalf)  # only the end-of-step relay is under test
    fence, thread = FakeFence(), _Recorder()
    worker._fence = fence
    worker._thread = thread  # type: ignore[assignment]
    worker.end_of_step(StepPlan())
    assert not fence.events, "no order, no event"
    finished = [PrefillFinished("p1", "t:1", (1,)), PrefillFinished("p2", "t:2", (2,))]
    worker.end_of_step(StepPlan(completing=finished))
    [event] = fence.events
    assert thread.submitted == [(finished[0], event), (finished[1], event)]
