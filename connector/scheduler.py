"""Scheduler-side half: turns vLLM scheduler hooks into a ``StepPlan`` for the worker half.

Runs in the EngineCore process, on the scheduler's thread; holds no lock and starts no thread.
It never talks to the peer: everything it decides rides to the worker in the step's metadata.
It imports nothing from vLLM: ``connector.plugin`` translates vLLM's types (request status, the
metadata class) and passes vLLM's objects, which this module reads only through the small
protocols below.

Bookkeeping (all keyed by vLLM request id):

* ``_awaiting`` (decode): registered, not yet reported received. If vLLM finishes such a request
  (abort, client gone), vLLM itself keeps its blocks until the worker reports it received; we
  add a cancel to the plan, and the worker reports it only once prefill cannot write any more.
  No cancel for ``Ending.ERROR``: that is vLLM failing a receive we reported failed (its
  ``finished_recving`` frees the blocks, at once or at the quarantine's hold deadline); any other
  error just waits for the transfer's own end (Done, Failure, link loss or deadline), blocks held.
  A quarantined receive is reported failed and finished at once (so vLLM fails the request now);
  ``update_connector_output`` withholds that finish from vLLM and keeps the id here until every rank
  that quarantined it lifted it (its blocks freed at its hold deadline: ``lifted`` in the workers'
  metadata, never a second finish, which vLLM's per-rank count could not complete when ranks end a
  request differently); ``take_lifted`` hands the finish to vLLM then (``plugin`` adds it to
  ``finished_recving``). Under TP a failure on one rank is turned into a cancel on every rank.
* ``_cancelling`` (decode): the finished subset of ``_awaiting``; keeps the engine stepping.
* ``_p_legs`` (prefill): prefill legs seen in scheduling: pairing key and prompt length.
* ``_completing`` (prefill, guarantee G10): legs whose last prompt token was scheduled in a step;
  the plan of that step carries ``PrefillFinished`` in ``completing`` and the worker posts the WRITE
  at the end of that very step (``wait_for_save``), not one step later from ``request_finished``.
  Their blocks stay held until the worker reports them sent, whatever ``request_finished`` says.
* ``_progressing`` (prefill, guarantee G14, progressive push): chunked legs that ordered a WRITE of the
  full blocks of a step (``PrefillProgress`` in that step's ``progress``, posted from its
  ``wait_for_save``). A partial WRITE may read their blocks, so whatever ends them (abort, error)
  keeps the blocks held (``PrefillFailed(held=True)``) until the worker reports them sent, which it
  does once no WRITE of the transfer is in flight. A leg that vLLM preempted and resumed orders
  ``PrefillRestarted`` and no more partial WRITEs: the final WRITE writes every block again.
* ``_held`` (prefill): blocks kept for a transfer until the worker reports them sent.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from connector.wire.metadata import DecodeLeg, PeerAddress, PrefillAnswer, PrefillLeg, ProtocolError, pairing_key
from connector.wire.plan import (
    CancelUnallocated,
    PrefillFailed,
    PrefillFinished,
    PrefillPreempted,
    PrefillProgress,
    PrefillRestarted,
    RegisterOrder,
    StepPlan,
)

logger = logging.getLogger(__name__)


class Ending(enum.Enum):
    """How vLLM finished a request, as far as this half cares (``plugin`` maps vLLM's status)."""

    OK = "ok"  # stopped or length-capped: the prompt's KV is complete
    ERROR = "error"  # FINISHED_ERROR (e.g. a receive this connector reported failed)
    ABORTED = "aborted"  # aborted, ignored or anything else without complete KV


class RequestView(Protocol):
    """What this half reads of a vLLM ``Request``."""

    @property
    def request_id(self) -> str: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def sampling_params(self) -> Any: ...


class BlocksView(Protocol):
    def get_unhashed_block_ids(self) -> list[int]: ...


@dataclass
class _PLeg:
    key: str
    prompt_len: int
    early: bool  # one-token leg: eligible for the WRITE in its completing step
    blocks: list[int]
    full_sent: int = 0  # progressive: full blocks already ordered written (G14)
    progressive: bool = True  # False once preempted: only the final WRITE
    scheduled: bool = False  # seen in a step: a later ``scheduled_new_reqs`` entry is a resume


class SchedulerHalf:
    def __init__(
        self,
        engine_id: str,
        side_host: str,
        side_port: int,
        block_size: int = 0,
        early_write: bool = True,
        *,
        progressive: bool = False,
        tp_size: int = 1,
        pp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id
        self.tp_size, self.pp_size = tp_size, pp_size  # this engine's; answered to the router
        self._quarantines: Counter[str] = Counter()  # D: ranks still holding a quarantined receive
        self._withheld: set[str] = set()  # D: aggregated finishes kept from vLLM until every rank lifted
        self._lifted: set[str] = set()  # D: finishes to hand to vLLM now (``take_lifted``)
        self._failing: set[str] = set()  # D: failed on some rank, cancelled on every rank
        self.side_host, self.side_port = side_host, side_port
        self._block_size = block_size
        self._early_write = early_write
        self._plan = StepPlan()
        self._awaiting: set[str] = set()
        self._cancelling: set[str] = set()
        self._p_legs: dict[str, _PLeg] = {}
        self._completing: set[str] = set()
        self._progressive = progressive and early_write and block_size > 0
        self._progressing: set[str] = set()
        self._held: set[str] = set()

    # ---- decode side (and prefill legs seen while scheduling) ----------------------------

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self._note_prefill_leg(request)
        try:
            leg = DecodeLeg.parse(request.kv_transfer_params)
        except ProtocolError:
            logger.warning("request %s: incomplete decode-leg params; computing locally", request.request_id)
            return 0, False
        if leg is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: RequestView, blocks: BlocksView, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        leg = DecodeLeg.parse(params) if num_external_tokens > 0 else None
        if leg is None or params is None:
            return
        key = pairing_key(leg.transfer_id, request.request_id)
        # Each worker rank works out which prefill ranks it registers with (``connector.parallel.ranks``).
        peer = PeerAddress(leg.remote_engine_id, leg.remote_host, leg.remote_port, leg.tp_size, leg.pp_size)
        # Only the blocks without a local prefix-cache hit: prefill writes exactly these (tail-aligned).
        block_ids = tuple(blocks.get_unhashed_block_ids())
        num_tokens = len(request.prompt_token_ids or ())
        self._plan.register.append(RegisterOrder(request.request_id, key, peer, block_ids, num_tokens))
        self._awaiting.add(request.request_id)
        params["do_remote_prefill"] = False  # a preempted, rescheduled request does not register again

    # ---- both sides ----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        if self._p_legs and scheduler_output is not None:
            self._find_completing(scheduler_output)
        plan, self._plan = self._plan, StepPlan()
        return plan

    def update_connector_output(
        self,
        finished_recving: Iterable[str],
        finished_sending: Iterable[str],
        quarantined: Mapping[str, int] | Iterable[str] = (),
        lifted: Mapping[str, int] | Iterable[str] = (),
        failed: Iterable[str] = (),
    ) -> set[str]:
        """Apply the workers' reports; return the ids ``plugin`` must strip from vLLM's ``finished_recving``.

        ``quarantined``: receives a rank reported failed and finished in this step only so that vLLM passes
        the failure on now (its output aggregator holds a failure back until every rank finished); with the
        number of ranks. Their blocks stay held (the aggregated finish withheld, request kept in ``_awaiting``)
        until as many ranks ``lifted`` them (at their hold deadlines, G2, G3); ``take_lifted`` then hands the
        finish to vLLM. ``failed``: receives any rank failed in this step; with several ranks each is cancelled
        on every rank at once (the others stop waiting for their own parts).
        """
        self._quarantines.update({r: n for r, n in Counter(quarantined).items() if r in self._awaiting})
        self._quarantines.subtract(Counter(lifted))
        for request_id in [r for r, n in self._quarantines.items() if n <= 0]:
            del self._quarantines[request_id]
            if request_id in self._withheld:
                self._withheld.discard(request_id)
                self._lifted.add(request_id)
                self._finish_receive(request_id)
        withheld: set[str] = set()
        for request_id in finished_recving:
            if request_id in self._quarantines:
                withheld.add(request_id)
                self._withheld.add(request_id)
                continue
            self._finish_receive(request_id)
        if self.tp_size * self.pp_size > 1:
            for request_id in failed:
                if request_id in self._awaiting and request_id not in self._failing | self._cancelling:
                    self._failing.add(request_id)
                    self._plan.cancel.append(request_id)
        for request_id in finished_sending:
            self._held.discard(request_id)
            self._completing.discard(request_id)
            self._progressing.discard(request_id)
        return withheld

    def take_lifted(self) -> set[str]:
        """Quarantined receives every rank has now freed: add them to vLLM's ``finished_recving``."""
        lifted, self._lifted = self._lifted, set()
        return lifted

    def _finish_receive(self, request_id: str) -> None:
        self._awaiting.discard(request_id)
        self._cancelling.discard(request_id)
        self._failing.discard(request_id)

    def request_finished(
        self, request: RequestView, block_ids: list[int], ending: Ending
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        if request_id in self._awaiting:
            self._cancelling.add(request_id)
            if ending is not Ending.ERROR and request_id not in self._failing:
                self._plan.cancel.append(request_id)
            return False, None  # vLLM holds the blocks until we report the request received
        self._cancel_unallocated(request)
        p_leg = self._p_legs.pop(request_id, None)
        leg = PrefillLeg.parse(request.kv_transfer_params)
        if leg is None:
            return False, None
        answer = self._answer(request, block_ids, leg.transfer_id)
        if request_id in self._completing:
            # The WRITE was ordered in the completing step: hold the blocks until Release (G10).
            return True, answer.to_params() if ending is Ending.OK else None
        key = p_leg.key if p_leg is not None else pairing_key(leg.transfer_id, request_id)
        if ending is not Ending.OK and request_id in self._progressing:
            # A partial WRITE may read these blocks: held until the worker reports them sent (G14).
            self._plan.failed.append(PrefillFailed(request_id, key, ending.name, held=True))
            self._held.add(request_id)
            return True, None
        if ending is not Ending.OK or not block_ids:
            self._plan.failed.append(PrefillFailed(request_id, key, ending.name))
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        self._plan.finished.append(PrefillFinished(request_id, key, tuple(block_ids), num_tokens))
        self._held.add(request_id)
        return True, answer.to_params()

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._cancelling or self._quarantines or self._lifted or not self._plan.is_empty())

    # ---- helpers -------------------------------------------------------------------------

    def _answer(self, request: RequestView, block_ids: list[int], transfer_id: str | None) -> PrefillAnswer:
        return PrefillAnswer(
            remote_engine_id=self.engine_id,
            remote_host=self.side_host,
            remote_port=self.side_port,
            remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=request.num_computed_tokens,
            transfer_id=transfer_id,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
        )

    def _note_prefill_leg(self, request: RequestView) -> None:
        if request.request_id in self._p_legs:
            return
        leg = PrefillLeg.parse(request.kv_transfer_params)
        if leg is None:
            return
        params = request.sampling_params
        one_token = getattr(params, "max_tokens", None) == 1
        key = pairing_key(leg.transfer_id, request.request_id)
        self._p_legs[request.request_id] = _PLeg(key, len(request.prompt_token_ids or ()), one_token, [])

    def _find_completing(self, out: Any) -> None:
        """Prefill legs whose last prompt token is computed in this step: order their WRITE now.

        Only one-token legs (the router's P leg) qualify: they finish in this step's output, so
        vLLM learns they finished before it can read a ``finished_sending`` for them.

        Preemption is read in every shape vLLM has used (0.32-0.34): ``preempted_req_ids`` names the
        legs preempted since the last step (their blocks are already freed); a resumed leg comes back
        in ``scheduled_cached_reqs`` with ``resumed_req_ids`` (the V1 model runner, 0.32/0.33) or in
        ``scheduled_new_reqs`` again (Model Runner V2; 0.34 has no ``resumed_req_ids`` at all).
        """
        scheduled: dict[str, int] = out.num_scheduled_tokens
        for request_id in getattr(out, "preempted_req_ids", None) or ():
            leg = self._p_legs.get(request_id)
            if leg is not None:
                self._preempted(request_id, leg)
        for new in out.scheduled_new_reqs:
            leg = self._p_legs.get(new.req_id)
            if leg is None:
                continue
            if leg.scheduled:  # seen in an earlier step: resumed after a preemption (Model Runner V2)
                self._restart(new.req_id, leg)
            leg.scheduled = True
            leg.blocks = list(new.block_ids[0]) if new.block_ids else []
            self._maybe_complete(new.req_id, leg, new.num_computed_tokens, scheduled)
        cached = out.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
        for i, request_id in enumerate(cached.req_ids):
            leg = self._p_legs.get(request_id)
            if leg is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = request_id in resumed_ids
            if resumed:
                self._restart(request_id, leg)
            if new_blocks is not None:
                fresh = list(new_blocks[0])
                leg.blocks = fresh if resumed else leg.blocks + fresh
            self._maybe_complete(request_id, leg, cached.num_computed_tokens[i], scheduled)

    def _preempted(self, request_id: str, leg: _PLeg) -> None:
        """vLLM preempted the leg and freed its blocks; this step's forward may overwrite them. A WRITE of
        the leg may still be reading them: the plan's ``preempted`` makes the worker wait for it before the
        forward (``handle_preemptions``, guarantee G2 on P's side)."""
        if request_id in self._progressing or request_id in self._completing:
            self._plan.preempted.append(PrefillPreempted(request_id, leg.key))
        self._restart(request_id, leg)
        leg.blocks = []

    def _restart(self, request_id: str, leg: _PLeg) -> None:
        """Recomputed KV is not bitwise the old one: no more partial WRITEs; the final one writes every block."""
        if leg.full_sent:  # partial WRITEs were ordered: tell the machines once
            self._plan.restarted.append(PrefillRestarted(request_id, leg.key))
        leg.progressive, leg.full_sent = False, 0

    def _maybe_complete(self, request_id: str, leg: _PLeg, num_computed: int, scheduled: dict[str, int]) -> None:
        if not (self._early_write and leg.early) or request_id in self._completing:
            return
        computed = num_computed + scheduled.get(request_id, 0)
        if computed < leg.prompt_len or not leg.blocks:
            if self._progressive and leg.progressive:
                self._progress(request_id, leg, computed)
            return
        blocks = leg.blocks
        if self._block_size:
            blocks = blocks[: -(-leg.prompt_len // self._block_size)]
        self._plan.completing.append(PrefillFinished(request_id, leg.key, tuple(blocks), leg.prompt_len))
        self._completing.add(request_id)
        self._held.add(request_id)

    def _progress(self, request_id: str, leg: _PLeg, computed: int) -> None:
        """A step of a chunked prefill leg: order the WRITE of the full blocks it completed (G14). Only
        full blocks: the partial last block goes with the final WRITE (the completing step's)."""
        full = min(computed // self._block_size, len(leg.blocks))
        if full <= leg.full_sent:
            return
        total = -(-leg.prompt_len // self._block_size)
        self._plan.progress.append(
            PrefillProgress(request_id, leg.key, tuple(leg.blocks[:full]), total, leg.prompt_len)
        )
        leg.full_sent = full
        self._progressing.add(request_id)

    def _cancel_unallocated(self, request: RequestView) -> None:
        """A decode leg finished before it allocated blocks (``do_remote_prefill`` still set): P may
        hold blocks for it until its lease ends, so tell P (guarantee G5: nothing held for long)."""
        try:
            leg = DecodeLeg.parse(request.kv_transfer_params)
        except ProtocolError:
            return
        if leg is None:
            return
        key = pairing_key(leg.transfer_id, request.request_id)
        peer = PeerAddress(leg.remote_engine_id, leg.remote_host, leg.remote_port, leg.tp_size, leg.pp_size)
        self._plan.cancel_unallocated.append(CancelUnallocated(request.request_id, key, peer))
