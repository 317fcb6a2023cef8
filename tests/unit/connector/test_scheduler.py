"""SchedulerHalf: vLLM's scheduler hooks in, step plans and block holds out (requests are stand-ins).

The half imports nothing from vLLM, so these tests run without it. Guarantee numbers: connector/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from connector.scheduler import Ending, SchedulerHalf
from connector.wire.metadata import PeerAddress
from connector.wire.plan import (
    PrefillFailed,
    PrefillFinished,
    PrefillPreempted,
    PrefillProgress,
    PrefillRestarted,
    StepPlan,
)


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(40)))
    num_computed_tokens: int = 0
    sampling_params: Any = field(default_factory=lambda: SimpleNamespace(max_tokens=1))


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_unhashed_block_ids(self) -> list[int]:
        return self._ids


def d_params(tid: str = "xfer-1") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "kvp-1",
        "transfer_id": tid,
    }


def half(early_write: bool = True) -> SchedulerHalf:
    return SchedulerHalf("p0", "127.0.0.1", 5600, block_size=16, early_write=early_write)


def plan(h: SchedulerHalf, out: Any = None) -> StepPlan:
    return h.build_connector_meta(out)


def report(h: SchedulerHalf, recv: Iterable[str] = (), sent: Iterable[str] = ()) -> None:
    h.update_connector_output(set(recv), set(sent))


def registered(h: SchedulerHalf, rid: str = "d-1") -> Req:
    req = Req(rid, d_params())
    assert h.get_num_new_matched_tokens(req, 0) == (40, True)
    h.update_state_after_alloc(req, Blocks([3, 4, 5]), 40)
    return req


def test_a_decode_leg_asks_for_the_whole_prompt_and_registers_its_new_blocks() -> None:
    h = half()
    req = registered(h)
    (order,) = plan(h).register
    assert (order.request_id, order.key, order.block_ids) == ("d-1", "t:xfer-1", (3, 4, 5))
    assert order.peer == PeerAddress("p0", "127.0.0.1", 5600)
    assert h.get_num_new_matched_tokens(req, 0) == (0, False), "a rescheduled request must not register again"
    assert h.has_pending_push_work() is False
    report(h, recv={"d-1"})
    assert plan(h).is_empty()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": True}])
def test_no_decode_leg_or_an_incomplete_one_computes_locally(params: dict[str, Any] | None) -> None:
    assert half().get_num_new_matched_tokens(Req("r", params), 0) == (0, False)


def test_an_aborted_waiting_request_is_cancelled_and_held_until_reported() -> None:
    h = half()
    req = registered(h)
    plan(h)
    assert h.request_finished(req, [3, 4, 5], Ending.ABORTED) == (False, None)
    assert plan(h).cancel == ["d-1"]
    assert h.has_pending_push_work(), "the engine must keep stepping until the connector releases the blocks"
    report(h, recv={"d-1"})
    assert not h.has_pending_push_work()


def test_a_failed_receive_is_not_cancelled_back_to_the_prefill() -> None:
    """vLLM fails the request (FINISHED_ERROR) in the step that reports the failed receive, then frees it."""
    h = half()
    req = registered(h)
    plan(h)
    assert h.request_finished(req, [3, 4, 5], Ending.ERROR) == (False, None)
    assert plan(h).is_empty()
    report(h, recv={"d-1"})
    assert not h.has_pending_push_work()


def test_a_finished_prefill_holds_its_blocks_and_answers_push_params() -> None:
    h = half()
    req = Req("p-1", {"do_remote_decode": True, "transfer_id": "xfer-9"}, num_computed_tokens=40)
    delay, params = h.request_finished(req, [7, 8, 9], Ending.OK)
    assert delay is True and params is not None
    assert params["transfer_mode"] == "push" and params["transfer_id"] == "xfer-9"
    assert (params["remote_engine_id"], params["remote_port"], params["remote_block_ids"]) == ("p0", 5600, [7, 8, 9])
    (finished,) = plan(h).finished
    assert (finished.key, finished.block_ids) == ("t:xfer-9", (7, 8, 9))
    assert h.has_pending_push_work()
    report(h, sent={"p-1"})
    assert not h.has_pending_push_work()


@pytest.mark.parametrize("ending", [Ending.ABORTED, Ending.ERROR])
def test_a_prefill_that_ends_without_kv_tells_its_decode_and_holds_nothing(ending: Ending) -> None:
    h = half()
    req = Req("p-2", {"do_remote_decode": True, "transfer_id": "xfer-2"})
    assert h.request_finished(req, [1], ending) == (False, None)
    (failed,) = plan(h).failed
    assert failed.key == "t:xfer-2" and failed.reason == ending.name
    assert not h.has_pending_push_work()


def test_a_plain_request_is_left_to_vllm() -> None:
    req = Req("x", None)
    h = half()
    assert h.request_finished(req, [1, 2], Ending.OK) == (False, None)
    assert plan(h).is_empty()


def test_a_decode_request_finished_before_allocation_cancels_its_prefill() -> None:
    """G5: the prefill may hold finished blocks for it; a Cancel frees them before the lease ends."""
    h = half()
    req = Req("d-9", d_params("xfer-9"))
    assert h.request_finished(req, [], Ending.ABORTED) == (False, None)
    (order,) = plan(h).cancel_unallocated
    assert (order.request_id, order.key, order.peer) == ("d-9", "t:xfer-9", PeerAddress("p0", "127.0.0.1", 5600))
    assert not h.has_pending_push_work(), "vLLM holds no blocks for it"


def test_a_registration_carries_the_prompt_length() -> None:
    h = half()
    registered(h)
    (order,) = plan(h).register
    assert order.num_tokens == 40


# ---- issue 8 item 3: the WRITE is ordered in the step that computes the prompt's last token (G10) ----


def new_req(rid: str, blocks: list[int], computed: int = 0) -> Any:
    return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def step(new: Sequence[Any] = (), cached: Sequence[tuple[str, list[int] | None, int]] = (), **scheduled: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens={k.replace("_", "-"): v for k, v in scheduled.items()},
    )


def p_req(rid: str = "p-1", prompt: int = 40) -> Req:
    return Req(rid, {"do_remote_decode": True, "transfer_id": "x1"}, prompt_token_ids=list(range(prompt)))


def test_a_one_step_prefill_orders_its_write_in_the_step_that_computes_it() -> None:
    h = half()
    req = p_req()
    assert h.get_num_new_matched_tokens(req, 0) == (0, False)
    p = plan(h, step([new_req("p-1", [7, 8, 9])], p_1=40))
    assert p.completing == [PrefillFinished("p-1", "t:x1", (7, 8, 9), 40)]
    assert h.has_pending_push_work()
    req.num_computed_tokens = 40
    delay, params = h.request_finished(req, [7, 8, 9], Ending.OK)
    assert delay is True and params is not None and params["remote_block_ids"] == [7, 8, 9]
    assert plan(h).is_empty(), "no second order from request_finished"
    report(h, sent={"p-1"})
    assert not h.has_pending_push_work()


def test_a_chunked_prefill_orders_its_write_in_its_last_chunk_with_every_block() -> None:
    h = half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    assert plan(h, step([new_req("p-1", [1])], p_1=16)).completing == []
    assert plan(h, step(cached=[("p-1", [2], 16)], p_1=16)).completing == []
    (order,) = plan(h, step(cached=[("p-1", [3], 32)], p_1=8)).completing
    assert order.block_ids == (1, 2, 3) and order.num_tokens == 40


def test_blocks_stay_held_until_release_whatever_request_finished_is_told() -> None:
    """An abort after the completing step: the WRITE may be in flight, so vLLM must keep the blocks."""
    h = half()
    req = p_req()
    h.get_num_new_matched_tokens(req, 0)
    plan(h, step([new_req("p-1", [7, 8, 9])], p_1=40))
    assert h.request_finished(req, [7, 8, 9], Ending.ABORTED) == (True, None)
    assert plan(h).failed == [], "the decode may still get valid KV"
    assert h.has_pending_push_work()
    report(h, sent={"p-1"})
    assert not h.has_pending_push_work()


def test_without_early_write_or_for_longer_legs_the_order_waits_for_request_finished() -> None:
    for h, req in ((half(early_write=False), p_req()), (half(), p_req())):
        if h._early_write:
            req.sampling_params = SimpleNamespace(max_tokens=4)
        h.get_num_new_matched_tokens(req, 0)
        assert plan(h, step([new_req("p-1", [7, 8, 9])], p_1=40)).completing == []
        h.request_finished(req, [7, 8, 9], Ending.OK)
        assert [o.block_ids for o in plan(h).finished] == [(7, 8, 9)]


# ---- a quarantined receive: vLLM fails the request now, the blocks stay held (G2, G3) ---------------------


def test_a_quarantined_receive_is_withheld_from_vllm_until_its_hold_deadline() -> None:
    """The worker reports a quarantine failed *and* finished (vLLM's output aggregator passes a failure on
    only with a finish); vLLM fails the request (request_finished with ERROR), then reads finished_recving.
    The half must withhold that finish, or vLLM frees blocks a WRITE may still land in."""
    h = half()
    req = registered(h)
    plan(h)
    assert h.request_finished(req, [3, 4, 5], Ending.ERROR) == (False, None)
    withheld = h.update_connector_output({"d-1"}, set(), quarantined={"d-1"})
    assert withheld == {"d-1"}, "vLLM would free the quarantined blocks now"
    assert plan(h).is_empty(), "no cancel: the prefill is gone or failed"
    assert h.has_pending_push_work(), "the engine must keep stepping until the hold deadline"
    assert h.update_connector_output(set(), set(), lifted={"d-1"}) == set()
    assert h.take_lifted() == {"d-1"}, "the hold deadline's lift hands vLLM the finish: it frees the blocks"
    assert not h.has_pending_push_work()


def test_a_quarantine_before_vllm_finishes_the_request_is_withheld_too() -> None:
    """kv_load_failure_policy=recompute: vLLM does not finish the request; it must still wait for the deadline."""
    h = half()
    req = registered(h)
    plan(h)
    assert h.update_connector_output({"d-1"}, set(), quarantined={"d-1"}) == {"d-1"}
    assert h.request_finished(req, [3, 4, 5], Ending.ABORTED) == (False, None), "still held"
    assert plan(h).cancel == ["d-1"]
    assert h.update_connector_output(set(), set(), lifted={"d-1"}) == set()
    assert h.take_lifted() == {"d-1"}
    assert not h.has_pending_push_work()


def test_a_rank_that_lifts_before_the_others_finished_lets_the_finish_through_when_it_comes() -> None:
    h = half()
    registered(h)
    plan(h)
    h.update_connector_output(set(), set(), quarantined={"d-1": 1}, failed={"d-1"})
    h.update_connector_output(set(), set(), lifted={"d-1": 1})  # its hold deadline passed first
    assert h.update_connector_output({"d-1"}, set()) == set(), "every rank finished: nothing held any more"
    assert h.take_lifted() == set() and not h.has_pending_push_work()


def test_under_tp_a_failure_on_one_rank_is_cancelled_on_every_rank_once() -> None:
    h = SchedulerHalf("d", "127.0.0.1", 5600, 16, tp_size=2)
    req = registered(h)
    plan(h)
    h.update_connector_output(set(), set(), failed={"d-1"})
    h.update_connector_output(set(), set(), failed={"d-1"})
    assert plan(h).cancel == ["d-1"]
    assert h.request_finished(req, [3, 4, 5], Ending.ABORTED) == (False, None)
    assert plan(h).cancel == [], "already cancelled on every rank"


def test_the_prefill_answer_states_the_engines_tp_and_pp() -> None:
    h = SchedulerHalf("p", "127.0.0.1", 5600, 16, tp_size=4)
    assert h._answer(SimpleNamespace(request_id="p-1", num_computed_tokens=3), [1], "x").to_params()["tp_size"] == 4


def test_a_plain_failure_or_a_finish_is_passed_to_vllm_at_once() -> None:
    h = half()
    registered(h, "d-1")
    registered(h, "d-2")
    plan(h)
    assert h.update_connector_output({"d-1", "d-2"}, set(), quarantined={"other"}) == set()
    assert not h.has_pending_push_work()


# ---- issue 8 item 4: progressive push, each step's full blocks are ordered written at its end (G14) --------


def progressive_half() -> SchedulerHalf:
    return SchedulerHalf("p0", "127.0.0.1", 5600, block_size=16, early_write=True, progressive=True)


def resumed_step(rid: str, blocks: list[int], computed: int, scheduled: int) -> Any:
    out = step(cached=[(rid, blocks, computed)])
    out.num_scheduled_tokens = {rid: scheduled}
    out.scheduled_cached_reqs.resumed_req_ids = {rid}
    return out


def test_a_chunked_prefill_orders_each_steps_full_blocks_and_the_partial_last_block_only_at_the_end() -> None:
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    first = plan(h, step([new_req("p-1", [1])], p_1=16))
    assert first.progress == [PrefillProgress("p-1", "t:x1", (1,), 3, 40)] and first.completing == []
    second = plan(h, step(cached=[("p-1", [2], 16)], p_1=16))
    assert [o.block_ids for o in second.progress] == [(1, 2)]
    last = plan(h, step(cached=[("p-1", [3], 32)], p_1=8))
    assert last.progress == [], "the partial last block goes with the final WRITE"
    assert [o.block_ids for o in last.completing] == [(1, 2, 3)]


def test_a_step_that_completes_no_new_block_orders_nothing() -> None:
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    assert plan(h, step([new_req("p-1", [1])], p_1=10)).progress == []
    assert [o.block_ids for o in plan(h, step(cached=[("p-1", [2], 10)], p_1=10)).progress] == [(1,)]
    assert plan(h, step(cached=[("p-1", None, 20)], p_1=10)).progress == []


def test_without_progressive_push_no_partial_write_is_ordered() -> None:
    h = half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    assert plan(h, step([new_req("p-1", [1])], p_1=16)).progress == []
    assert plan(h, step(cached=[("p-1", [2], 16)], p_1=16)).progress == []


def test_an_abort_after_a_partial_write_keeps_the_blocks_held_until_release() -> None:
    h = progressive_half()
    req = p_req()
    h.get_num_new_matched_tokens(req, 0)
    plan(h, step([new_req("p-1", [1])], p_1=16))
    assert h.request_finished(req, [1, 2], Ending.ABORTED) == (True, None), "a partial WRITE may read them"
    assert plan(h).failed == [PrefillFailed("p-1", "t:x1", "ABORTED", held=True)]
    assert h.has_pending_push_work()
    report(h, sent={"p-1"})
    assert not h.has_pending_push_work()


def test_an_abort_before_any_partial_write_frees_at_once() -> None:
    h = progressive_half()
    req = p_req()
    h.get_num_new_matched_tokens(req, 0)
    plan(h, step([new_req("p-1", [1])], p_1=10))  # no full block yet
    assert h.request_finished(req, [1], Ending.ABORTED) == (False, None)
    assert plan(h).failed == [PrefillFailed("p-1", "t:x1", "ABORTED")]


def test_a_preempted_leg_restarts_and_orders_no_more_partial_writes() -> None:
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    plan(h, step([new_req("p-1", [1])], p_1=16))
    again = plan(h, resumed_step("p-1", [5], 0, 16))
    assert again.restarted == [PrefillRestarted("p-1", "t:x1")] and again.progress == []
    assert plan(h, step(cached=[("p-1", [6], 16)], p_1=16)).progress == []
    (final,) = plan(h, step(cached=[("p-1", [7], 32)], p_1=8)).completing
    assert final.block_ids == (5, 6, 7)


# ---- issue 38: the shapes of vLLM 0.33/0.34 and Model Runner V2 ------------------------------------------------


def v034_step(new: Sequence[Any] = (), cached: Sequence[tuple[str, list[int] | None, int]] = (), **n: int) -> Any:
    """vLLM 0.34's SchedulerOutput: ``CachedRequestData`` has no ``resumed_req_ids`` any more."""
    out = step(new, cached, **n)
    del out.scheduled_cached_reqs.resumed_req_ids
    out.preempted_req_ids = set()
    return out


def preempting(out: Any, *ids: str) -> Any:
    out.preempted_req_ids = set(ids)
    return out


def test_a_chunked_leg_survives_a_scheduler_output_without_resumed_req_ids() -> None:
    """0.34 removed ``resumed_req_ids``: reading it raised inside ``Scheduler.schedule`` on every second chunk."""
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    plan(h, v034_step([new_req("p-1", [1])], p_1=16))
    assert [o.block_ids for o in plan(h, v034_step(cached=[("p-1", [2], 16)], p_1=16)).progress] == [(1, 2)]
    (final,) = plan(h, v034_step(cached=[("p-1", [3], 32)], p_1=8)).completing
    assert final.block_ids == (1, 2, 3)


@pytest.mark.parametrize("shape", [step, v034_step])
def test_a_preemption_fences_the_legs_writes_and_a_resume_in_new_reqs_restarts_it(shape: Any) -> None:
    """Model Runner V2 (0.32/0.33 on GPU, 0.34 everywhere): a resumed leg comes back in ``scheduled_new_reqs``."""
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    assert plan(h, shape([new_req("p-1", [1])], p_1=16)).progress[0].block_ids == (1,)
    pre = plan(h, preempting(shape(), "p-1"))
    assert pre.preempted == [PrefillPreempted("p-1", "t:x1")], "the forward must wait for the partial WRITE"
    assert pre.restarted == [PrefillRestarted("p-1", "t:x1")] and pre.progress == []
    again = plan(h, shape([new_req("p-1", [5])], p_1=16))
    assert again.restarted == [] and again.progress == [] and again.preempted == [], "told once, at preemption"
    assert plan(h, shape(cached=[("p-1", [6], 16)], p_1=16)).progress == []
    (final,) = plan(h, shape(cached=[("p-1", [7], 32)], p_1=8)).completing
    assert final.block_ids == (5, 6, 7), "only the recomputed blocks, never a pre-preemption one"


def test_a_resume_in_new_reqs_without_a_preemption_notice_still_restarts() -> None:
    """Defensive: a vLLM that names no preempted ids still shows the resume by the leg's second new entry."""
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    plan(h, step([new_req("p-1", [1])], p_1=16))
    again = plan(h, step([new_req("p-1", [5])], p_1=16))
    assert again.restarted == [PrefillRestarted("p-1", "t:x1")] and again.progress == []
    assert plan(h, step(cached=[("p-1", [6], 16)], p_1=16)).progress == []
    (final,) = plan(h, step(cached=[("p-1", [7], 32)], p_1=8)).completing
    assert final.block_ids == (5, 6, 7)


def test_a_leg_preempted_before_any_write_needs_no_fence() -> None:
    h = progressive_half()
    h.get_num_new_matched_tokens(p_req(prompt=40), 0)
    plan(h, step([new_req("p-1", [1])], p_1=10))  # no full block yet: nothing ordered written
    pre = plan(h, preempting(step(), "p-1"))
    assert pre.preempted == [] and pre.restarted == []
    assert plan(h, step([new_req("p-1", [5])], p_1=16)).progress == [], "no partial WRITE after a preemption"


def test_a_preempted_request_that_is_not_a_prefill_leg_is_ignored() -> None:
    h = progressive_half()
    assert plan(h, preempting(step(), "other")).is_empty()
