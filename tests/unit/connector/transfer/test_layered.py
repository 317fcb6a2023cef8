"""Layer-wise push (``connector.transfer.layered``): the pure decision (``LayerParts``, ``StepLayers``), the backend
that executes it over the in-memory backend, and two transfer threads with P in ``push_granularity: layer``.

What must hold: no part of a layer is posted before that layer's ReadyEvent completed (a CUDA event recorded
after the layer on a GPU: ``FakeEvent`` here); D hears Done only once every layer's part landed; a failure of
any part fails the request at once and posts nothing more; nothing is posted after the WRITE was released
(abort, cancel, deadline), so nothing lands in blocks D freed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from connector.options import Options
from connector.orders import CancelOrder
from connector.transfer.layered import LayeredBackend, LayerParts, StepLayers, StepsByKey
from connector.transfer.memory import MemoryBackend, MemoryFabric
from connector.transfer.ready import READY, ReadyEvent
from connector.transfer_thread import Results, TransferThread
from connector.wire.metadata import HandshakePayload, KVLayout, Region
from connector.wire.plan import PrefillFinished, PrefillProgress, StepPlan
from connector.worker import WorkerHalf
from tests.unit.connector.test_transfer_thread import (
    BLOCK_LEN,
    BLOCKS,
    CHANNEL,
    OPTIONS,
    Side,
    make_side,
    register,
    wait_for,
)
from tests.unit.connector.transfer.test_ready import FakeEvent, FakeFence

# ---- the decision ---------------------------------------------------------------------------------


def test_parts_post_each_run_of_ready_layers_once_in_order() -> None:
    parts = LayerParts(4, has_notice=True)
    assert parts.next_span(0) is None, "nothing before the first layer is in the cache"
    assert parts.next_span(1) == (0, 1)
    parts.on_posted((0, 1), parts.attach_notice((0, 1)))
    assert parts.next_span(1) is None, "a layer is posted once"
    assert parts.next_span(3) == (1, 3), "layers that became ready together go in one part"
    parts.on_posted((1, 3), False)
    assert parts.next_span(9) == (3, 4), "never past the last layer"
    assert parts.state() == "PROC"


def test_done_rides_on_the_last_part_only_when_every_earlier_part_landed() -> None:
    parts = LayerParts(2, has_notice=True)
    parts.on_posted((0, 1), parts.attach_notice((0, 1)))
    assert not parts.notice_attached, "an early part never carries Done"
    assert not parts.attach_notice((1, 2)), "layer 0 still in flight: Done cannot travel with layer 1"
    parts.on_posted((1, 2), False)
    parts.on_part_done()
    assert parts.state() == "PROC", "layer 1 still in flight"
    parts.on_part_done()
    assert parts.state() == "NOTIFY", "every layer landed: Done goes alone now"
    parts.on_notice_sent()
    assert parts.state() == "DONE"

    landed_first = LayerParts(2, has_notice=True)
    landed_first.on_posted((0, 1), False)
    landed_first.on_part_done()
    assert landed_first.attach_notice((1, 2)), "every earlier part landed: Done travels with the last"
    landed_first.on_posted((1, 2), True)
    landed_first.on_part_done()
    assert landed_first.state() == "DONE"
    assert LayerParts(1, has_notice=False).attach_notice((0, 1)) is False, "a partial WRITE has no Done"


def test_a_failed_part_fails_the_write_at_once_and_nothing_more_is_posted() -> None:
    parts = LayerParts(3, has_notice=True)
    parts.on_posted((0, 1), False)
    parts.on_part_failed()
    assert parts.state() == "ERR"
    assert parts.next_span(3) is None
    stopped = LayerParts(3, has_notice=True)
    stopped.on_posted((0, 1), False)
    stopped.stopped = True  # released: abandoned or cancelled
    assert stopped.next_span(3) is None


def test_step_layers_count_only_leading_layers_whose_events_completed() -> None:
    layers = StepLayers(3)
    first, second = FakeEvent(), FakeEvent()
    layers.mark(1, second)
    assert layers.ready() == 0, "layer 1 marked before layer 0: not a prefix"
    layers.mark(0, first)
    assert layers.ready() == 0, "layer 0's event has not completed"
    first.done = True
    assert layers.ready() == 1
    second.done = True
    end = FakeEvent()
    layers.close(end)
    assert layers.ready() == 2, "the layer never marked waits for the step's end event"
    end.done = True
    assert layers.ready() == 3
    layers.mark(2, READY)  # too late to change anything
    assert layers.ready() == 3


# ---- the backend over memory ----------------------------------------------------------------------


def _layout(arrays: list[np.ndarray]) -> KVLayout:
    return KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, BLOCK_LEN, BLOCKS) for a in arrays))


def test_a_memory_write_of_a_layer_range_moves_only_those_regions() -> None:
    fabric = MemoryFabric()
    src = [np.full(BLOCKS * BLOCK_LEN, i + 1, np.uint8) for i in range(3)]
    dst = [np.zeros(BLOCKS * BLOCK_LEN, np.uint8) for _ in range(3)]
    p, d = MemoryBackend(fabric, "p", _layout(src)), MemoryBackend(fabric, "d", _layout(dst))
    p.add_peer(HandshakePayload(3, "c", "d", "d", d.agent_metadata(), d.layout))
    ticket = p.write("d", (1,), (2,), b"", layers=(1, 2))
    while p.write_state(ticket.handle) == "PROC":
        pass
    assert ticket.num_bytes == BLOCK_LEN
    assert [int(a[2 * BLOCK_LEN]) for a in dst] == [0, 2, 0]


# ---- two transfer threads, P layer-wise -----------------------------------------------------------


def make_layered(fabric: MemoryFabric, fence: FakeFence | None = None) -> tuple[Side, LayeredBackend]:
    rng = np.random.default_rng(1)
    kv = [rng.integers(0, 256, BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(2)]
    layout = _layout(kv)
    inner = MemoryBackend(fabric, "agent-P", layout)
    backend = LayeredBackend(inner, len(layout.regions), BLOCK_LEN)
    thread = TransferThread(
        backend,
        engine_id="P",
        layout=layout,
        compat_hash="c1",
        side_host="127.0.0.1",
        side_port=0,
        options=OPTIONS,
        side_channel=CHANNEL,
        fence=fence,
    )
    thread.start()
    return Side(thread, inner, kv, Results()), backend


@pytest.fixture
def layered() -> Iterator[tuple[Side, Side, LayeredBackend]]:
    fabric = MemoryFabric()
    (p, backend), d = make_layered(fabric), make_side(fabric, "D", seed=None)
    yield p, d, backend
    d.thread.close()
    p.thread.close()


def region(side: Side, r: int, b: int) -> bytes:
    return side.kv[r][b * BLOCK_LEN : (b + 1) * BLOCK_LEN].tobytes()


ZERO = bytes(BLOCK_LEN)


def test_each_layer_lands_once_marked_and_decode_is_done_only_after_the_last(
    layered: tuple[Side, Side, LayeredBackend],
) -> None:
    p, d, backend = layered
    register(p, d, blocks=(5, 6))
    wait_for(lambda: "t:1" in p.thread._prefill.entries)
    step = StepLayers(2)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)), READY, step)
    time.sleep(0.05)
    assert p.backend.writes == {} and region(d, 0, 5) == ZERO, "a layer was written before it was computed"
    step.mark(0, READY)
    p.thread.kick()
    wait_for(lambda: region(d, 0, 5) + region(d, 0, 6) == region(p, 0, 1) + region(p, 0, 2))
    time.sleep(0.05)
    assert region(d, 1, 5) == ZERO, "layer 1 written before it was computed"
    assert "d1" not in d.collect().received, "Done before every layer landed"
    step.close(READY)
    p.thread.kick()
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released)
    assert d.results.failed == set()
    assert region(d, 1, 5) + region(d, 1, 6) == region(p, 1, 1) + region(p, 1, 2)
    assert backend.parts_posted == 2
    assert [r.num_bytes for r in p.results.records] == [2 * 2 * BLOCK_LEN], "one transfer, both layers"


def test_a_layer_waits_for_its_event_not_for_its_mark(layered: tuple[Side, Side, LayeredBackend]) -> None:
    p, d, backend = layered
    register(p, d, blocks=(5,))
    wait_for(lambda: "t:1" in p.thread._prefill.entries)
    step, event = StepLayers(2), FakeEvent()
    p.thread.submit(PrefillFinished("p1", "t:1", (3,)), READY, step)
    step.mark(0, event)  # the GPU's layer-0 kernels are still running
    p.thread.kick()
    wait_for(lambda: event.queries >= 3)
    assert backend.parts_posted == 0 and region(d, 0, 5) == ZERO, "WRITE posted before its layer's event"
    event.done = True
    step.close(READY)
    p.thread.kick()
    wait_for(lambda: "d1" in d.collect().received)
    assert region(d, 0, 5) + region(d, 1, 5) == region(p, 0, 3) + region(p, 1, 3)


def test_a_registration_after_the_forward_gets_one_part_with_done(layered: tuple[Side, Side, LayeredBackend]) -> None:
    p, d, backend = layered
    step = StepLayers(2)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)), READY, step)
    step.close(READY)
    register(p, d, blocks=(5, 6))
    wait_for(lambda: "d1" in d.collect().received)
    assert backend.parts_posted == 1, "every layer ready: one WRITE, as push_granularity step"
    assert p.collect().counters["writes_posted"] == 1


def test_a_failed_layer_fails_the_request_at_once_and_posts_nothing_more(
    layered: tuple[Side, Side, LayeredBackend],
) -> None:
    p, d, backend = layered
    register(p, d, blocks=(5, 6))
    wait_for(lambda: "t:1" in p.thread._prefill.entries)
    step = StepLayers(2)
    p.backend.fail_writes = True
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)), READY, step)
    step.mark(0, READY)
    p.thread.kick()
    wait_for(lambda: "d1" in d.collect().failed and "d1" in d.results.received)
    wait_for(lambda: "p1" in p.collect().released)
    p.backend.fail_writes = False
    step.close(READY)
    p.thread.kick()
    time.sleep(0.05)
    assert backend.parts_posted == 1, "a part posted after the WRITE failed"
    assert region(d, 1, 5) == ZERO


def test_an_abort_with_a_layer_in_flight_posts_no_more_and_frees_only_after_it(
    layered: tuple[Side, Side, LayeredBackend],
) -> None:
    p, d, backend = layered
    p.backend.polls_before_done = 40
    register(p, d, blocks=(5, 6))
    wait_for(lambda: "t:1" in p.thread._prefill.entries)
    step = StepLayers(2)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)), READY, step)
    step.mark(0, READY)
    p.thread.kick()
    wait_for(lambda: backend.parts_posted == 1)
    d.thread.submit(CancelOrder("d1"))  # decode aborted: its blocks are freed only once nothing can land
    wait_for(lambda: "d1" in d.collect().received)
    assert p.backend.in_flight_to("agent-D") == 0, "decode freed its blocks while a layer could still land"
    step.close(READY)
    p.thread.kick()
    wait_for(lambda: "p1" in p.collect().released)
    time.sleep(0.05)
    assert backend.parts_posted == 1, "a layer posted for a cancelled request"
    assert region(d, 1, 5) == ZERO


def test_chunks_are_pushed_layer_by_layer_and_the_last_chunk_carries_done(
    layered: tuple[Side, Side, LayeredBackend],
) -> None:
    p, d, backend = layered
    register(p, d, blocks=(4, 5, 6))
    wait_for(lambda: "t:1" in p.thread._prefill.entries)
    first = StepLayers(2)
    p.thread.submit(PrefillProgress("p1", "t:1", (1,), 3, 0), READY, first)
    first.mark(0, READY)
    p.thread.kick()
    wait_for(lambda: region(d, 0, 4) == region(p, 0, 1))
    first.close(READY)
    p.thread.kick()
    wait_for(lambda: region(d, 1, 4) == region(p, 1, 1))
    last = StepLayers(2)
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2, 3)), READY, last)
    last.mark(0, READY)
    p.thread.kick()
    wait_for(lambda: region(d, 0, 5) + region(d, 0, 6) == region(p, 0, 2) + region(p, 0, 3))
    assert "d1" not in d.collect().received
    last.close(READY)
    p.thread.kick()
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released)
    assert b"".join(region(d, r, b) for r in (0, 1) for b in (4, 5, 6)) == b"".join(
        region(p, r, b) for r in (0, 1) for b in (1, 2, 3)
    )
    assert backend.parts_posted == 4
    assert p.results.counters["writes_posted"] == 2, "one WRITE per chunk for the rendezvous"


# ---- the worker's hooks ---------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.submitted: list[tuple[object, ReadyEvent, StepLayers | None]] = []
        self.kicks = 0

    def submit(self, order: object, ready: ReadyEvent = READY, layers: StepLayers | None = None) -> None:
        self.submitted.append((order, ready, layers))

    def kick(self) -> None:
        self.kicks += 1


def test_the_worker_orders_pushes_at_step_start_and_marks_layers_as_vllm_saves_them() -> None:
    worker = WorkerHalf.__new__(WorkerHalf)  # only the step hooks are under test
    fence, thread = FakeFence(), _Recorder()
    worker._fence, worker._thread = fence, thread  # type: ignore[assignment]
    worker._layer_index = {"model.layers.0.attn": 0, "model.layers.1.attn": 1}
    finished = PrefillFinished("p1", "t:1", (1,))
    plan = StepPlan(completing=[finished])
    worker.start(plan)
    [(order, ready, step)] = thread.submitted
    assert order is finished and ready is READY and step is not None, "layer-wise orders enter at step start"
    worker.save_layer("model.layers.0.attn", plan)
    worker.save_layer("model.layers.9.attn", plan)  # not a registered region (an alias): ignored
    assert len(fence.events) == 1 and thread.kicks == 1
    fence.events[0].done = True
    assert step.ready() == 1
    worker.end_of_step(plan)
    assert len(thread.submitted) == 1, "nothing ordered twice"
    fence.events[1].done = True
    assert step.ready() == 2, "the layer vLLM did not report is ready after the step"
    worker.save_layer("model.layers.0.attn", StepPlan())  # a step without pushes: nothing recorded
    assert len(fence.events) == 2


def test_the_worker_orders_the_steps_pushes_at_its_first_layer_when_vllm_starts_it_after_the_forward() -> None:
    # vLLM 0.32 calls start_load_kv after the forward when a step has no sync loads: before this, every layer of
    # the link run 20261205T182006Z was unmarked at its save and all four were posted as one part after the step
    worker = WorkerHalf.__new__(WorkerHalf)
    fence, thread = FakeFence(), _Recorder()
    worker._fence, worker._thread = fence, thread  # type: ignore[assignment]
    worker._layer_index = {"model.layers.0.attn": 0, "model.layers.1.attn": 1}
    finished = PrefillFinished("p1", "t:1", (1,))
    plan = StepPlan(cancel=["d9"], completing=[finished])
    worker.save_layer("model.layers.0.attn", plan)
    assert [o for o, _, _ in thread.submitted] == [CancelOrder("d9"), finished], "the step's orders in start's order"
    step = thread.submitted[1][2]
    assert step is not None and len(fence.events) == 1
    fence.events[0].done = True
    assert step.ready() == 1, "layer 0 is marked as it is saved, not at the step's end"
    worker.save_layer("model.layers.1.attn", plan)
    worker.start(plan)  # start_load_kv after the forward
    assert len(thread.submitted) == 2, "nothing ordered twice"
    worker.end_of_step(plan)
    next_step = StepPlan(completing=[PrefillFinished("p2", "t:3", (2,))])
    worker.start(next_step)
    assert len(thread.submitted) == 3, "the next step is a step of its own"


def test_push_granularity_is_an_option_layer_wise_by_default() -> None:
    assert Options.from_extra({}).push_granularity == "layer", "the default since 2026-12-07 (connector/README.md)"
    assert Options.from_extra({"push_granularity": "step"}).push_granularity == "step"
    with pytest.raises(ValueError, match="push_granularity"):
        Options.from_extra({"push_granularity": "block"})


def test_a_key_s_step_is_kept_for_every_leg_and_dropped_only_once_no_leg_can_write() -> None:
    steps = StepsByKey()
    layers = StepLayers(2)
    steps.note("k", layers)
    for i in range(20):  # outgrow the slack so the sweep looks
        steps.note(f"old{i}", StepLayers(2))
    steps.sweep(lambda: {"k"})  # one leg of k ended, another is still live: k's step stays
    assert steps.for_write("k") is layers and len(steps) == 1
    steps.sweep(lambda: set(), slack=0)
    assert steps.for_write("k") is None
