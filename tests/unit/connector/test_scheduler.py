"""SchedulerHalf: vLLM's scheduler hooks in, step plans and block holds out (requests are stand-ins)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the scheduler half imports vLLM's connector base")

from vllm.v1.request import RequestStatus

from connector.metadata import PeerAddress, StepPlan
from connector.scheduler import SchedulerHalf


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(40)))
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0


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


def half() -> SchedulerHalf:
    return SchedulerHalf(None, "p0", "127.0.0.1", 5600)


def plan(h: SchedulerHalf) -> StepPlan:
    return h.build_connector_meta(None).plan


def output(recv: Iterable[str] = (), sent: Iterable[str] = ()) -> Any:
    return SimpleNamespace(finished_recving=set(recv), finished_sending=set(sent))


def registered(h: SchedulerHalf, rid: str = "d-1") -> Req:
    req = Req(rid, d_params())
    assert h.get_num_new_matched_tokens(req, 0) == (40, True)
    h.update_state_after_alloc(req, Blocks([3, 4, 5]), 40)
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    return req


def test_a_decode_leg_asks_for_the_whole_prompt_and_registers_its_new_blocks() -> None:
    h = half()
    req = registered(h)
    (order,) = plan(h).register
    assert (order.request_id, order.key, order.block_ids) == ("d-1", "t:xfer-1", (3, 4, 5))
    assert order.peer == PeerAddress("p0", "127.0.0.1", 5600)
    assert h.get_num_new_matched_tokens(req, 0) == (0, False), "a rescheduled request must not register again"
    assert h.has_pending_push_work() is False
    h.update_connector_output(output(recv={"d-1"}))
    assert plan(h).is_empty()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": True}])
def test_no_decode_leg_or_an_incomplete_one_computes_locally(params: dict[str, Any] | None) -> None:
    assert half().get_num_new_matched_tokens(Req("r", params), 0) == (0, False)


def test_an_aborted_waiting_request_is_cancelled_and_held_until_reported() -> None:
    h = half()
    req = registered(h)
    plan(h)
    req.status = RequestStatus.FINISHED_ABORTED
    assert h.request_finished(req, [3, 4, 5]) == (False, None)
    assert plan(h).cancel == ["d-1"]
    assert h.has_pending_push_work(), "the engine must keep stepping until the connector releases the blocks"
    h.update_connector_output(output(recv={"d-1"}))
    assert not h.has_pending_push_work()


def test_a_failed_receive_is_not_cancelled_back_to_the_prefill() -> None:
    """vLLM fails the request (FINISHED_ERROR) in the step that reports the failed receive, then frees it."""
    h = half()
    req = registered(h)
    plan(h)
    req.status = RequestStatus.FINISHED_ERROR
    assert h.request_finished(req, [3, 4, 5]) == (False, None)
    assert plan(h).is_empty()
    h.update_connector_output(output(recv={"d-1"}))
    assert not h.has_pending_push_work()


def test_a_finished_prefill_holds_its_blocks_and_answers_push_params() -> None:
    h = half()
    req = Req(
        "p-1",
        {"do_remote_decode": True, "transfer_id": "xfer-9"},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=40,
    )
    delay, params = h.request_finished(req, [7, 8, 9])
    assert delay is True and params is not None
    assert params["transfer_mode"] == "push" and params["transfer_id"] == "xfer-9"
    assert (params["remote_engine_id"], params["remote_port"], params["remote_block_ids"]) == ("p0", 5600, [7, 8, 9])
    (finished,) = plan(h).finished
    assert (finished.key, finished.block_ids) == ("t:xfer-9", (7, 8, 9))
    assert h.has_pending_push_work()
    h.update_connector_output(output(sent={"p-1"}))
    assert not h.has_pending_push_work()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_a_prefill_that_ends_without_kv_tells_its_decode_and_holds_nothing(status: RequestStatus) -> None:
    h = half()
    req = Req("p-2", {"do_remote_decode": True, "transfer_id": "xfer-2"}, status=status)
    assert h.request_finished(req, [1]) == (False, None)
    (failed,) = plan(h).failed
    assert failed.key == "t:xfer-2" and failed.reason == status.name
    assert not h.has_pending_push_work()


def test_a_plain_request_is_left_to_vllm() -> None:
    req = Req("x", None, status=RequestStatus.FINISHED_STOPPED)
    h = half()
    assert h.request_finished(req, [1, 2]) == (False, None)
    assert plan(h).is_empty()


def test_a_decode_request_finished_before_allocation_cancels_its_prefill() -> None:
    """G5: the prefill may hold finished blocks for it; a Cancel frees them before the lease ends."""
    h = half()
    req = Req("d-9", d_params("xfer-9"), status=RequestStatus.FINISHED_ABORTED)
    assert h.request_finished(req, []) == (False, None)
    (order,) = plan(h).cancel_unallocated
    assert (order.request_id, order.key, order.peer) == ("d-9", "t:xfer-9", PeerAddress("p0", "127.0.0.1", 5600))
    assert not h.has_pending_push_work(), "vLLM holds no blocks for it"


def test_a_registration_carries_the_prompt_length() -> None:
    h = half()
    registered(h)
    (order,) = plan(h).register
    assert order.num_tokens == 40
