"""Scheduler-side half: turns vLLM scheduler hooks into a ``StepPlan`` for the worker half.

Runs in the EngineCore process, on the scheduler's thread; holds no lock and starts no thread.
It never talks to the peer: everything it decides rides to the worker in ``KvpushMetadata``.

Bookkeeping (all keyed by vLLM request id):

* ``_awaiting`` (decode): registered, not yet reported received. If vLLM finishes such a request
  (abort, client gone), vLLM itself keeps its blocks until the worker reports it received; we
  add a cancel to the plan, and the worker reports it only once prefill cannot write any more.
  No cancel for ``FINISHED_ERROR``: that is vLLM failing a receive we reported failed in this very
  step (its ``finished_recving`` frees the blocks right after); any other error just waits for
  the transfer's own end (Done, Failure, peer lost or deadline), blocks still held.
* ``_cancelling`` (decode): the finished subset of ``_awaiting``; keeps the engine stepping.
* ``_held`` (prefill): blocks kept for a transfer until the worker reports them sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from connector.metadata import (
    CancelUnallocated,
    DecodeLeg,
    PeerAddress,
    PrefillFailed,
    PrefillFinished,
    PrefillLeg,
    ProtocolError,
    RegisterOrder,
    StepPlan,
    pairing_key,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_PREFILL_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class KvpushMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The step plan, as the metadata object vLLM carries from scheduler to workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class SchedulerHalf:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, side_host: str, side_port: int) -> None:
        self.engine_id = engine_id
        self.side_host, self.side_port = side_host, side_port
        self._plan = StepPlan()
        self._awaiting: set[str] = set()
        self._cancelling: set[str] = set()
        self._held: set[str] = set()

    # ---- decode side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            leg = DecodeLeg.parse(request.kv_transfer_params)
        except ProtocolError:
            logger.warning("request %s: incomplete decode-leg params; computing locally", request.request_id)
            return 0, False
        if leg is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        leg = DecodeLeg.parse(params) if num_external_tokens > 0 else None
        if leg is None or params is None:
            return
        if leg.tp_size != 1 or leg.pp_size != 1:
            logger.warning(
                "request %s: prefill tp/pp %d/%d > 1 is not supported", request.request_id, leg.tp_size, leg.pp_size
            )
        key = pairing_key(leg.transfer_id, request.request_id)
        peer = PeerAddress(leg.remote_engine_id, leg.remote_host, leg.remote_port)
        block_ids = tuple(blocks.get_unhashed_block_ids())
        num_tokens = len(request.prompt_token_ids or ())
        self._plan.register.append(RegisterOrder(request.request_id, key, peer, block_ids, num_tokens))
        self._awaiting.add(request.request_id)
        params["do_remote_prefill"] = False  # a preempted, rescheduled request does not register again

    # ---- both sides ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvpushMetadata:
        plan, self._plan = self._plan, StepPlan()
        return KvpushMetadata(plan)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving or ():
            self._awaiting.discard(request_id)
            self._cancelling.discard(request_id)
        for request_id in output.finished_sending or ():
            self._held.discard(request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._awaiting:
            self._cancelling.add(request_id)
            if request.status != RequestStatus.FINISHED_ERROR:
                self._plan.cancel.append(request_id)
            return False, None  # vLLM holds the blocks until we report the request received
        self._cancel_unallocated(request)
        leg = PrefillLeg.parse(request.kv_transfer_params)
        if leg is None:
            return False, None
        key = pairing_key(leg.transfer_id, request_id)
        if request.status not in _PREFILL_OK or not block_ids:
            self._plan.failed.append(PrefillFailed(request_id, key, str(request.status.name)))
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        self._plan.finished.append(PrefillFinished(request_id, key, tuple(block_ids), num_tokens))
        self._held.add(request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.side_host,
            "remote_port": self.side_port,
            "tp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": "push",
            "transfer_id": leg.transfer_id,
        }

    def _cancel_unallocated(self, request: Request) -> None:
        """A decode leg finished before it allocated blocks (``do_remote_prefill`` still set): P may
        hold blocks for it until its lease ends, so tell P (guarantee G5: nothing held for long)."""
        try:
            leg = DecodeLeg.parse(request.kv_transfer_params)
        except ProtocolError:
            return
        if leg is None:
            return
        key = pairing_key(leg.transfer_id, request.request_id)
        peer = PeerAddress(leg.remote_engine_id, leg.remote_host, leg.remote_port)
        self._plan.cancel_unallocated.append(CancelUnallocated(request.request_id, key, peer))

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._cancelling or not self._plan.is_empty())
