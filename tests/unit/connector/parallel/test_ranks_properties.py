"""Random interleavings of N P ranks x M D ranks (1-4 each) with faults per leg, through the real pieces that
aggregate ranks: per D rank ``connector.parallel.ranks.DecodeFanIn`` (as the transfer thread drives it) and the worker
half's report, vLLM's own ``KVOutputAggregator`` over the M ranks, and the scheduler half behind
``KvpushConnector.update_connector_output`` (quarantine book, cross-rank cancel).

Each leg (P rank -> D rank, from ``connector.parallel.topology``) lives as the decode machine lets it: pending, then
``done`` (its data landed), ``ended`` (a plain failure or a cancel acknowledged: nothing can land) or
``quarantined`` (failed, a WRITE may still land) and later ``freed`` (its hold deadline). A cancelled pending
leg ends ``ended`` or, racing, ``done``. Hypothesis picks which leg moves when, engine steps, and client aborts.

Invariants: vLLM frees the blocks exactly once and only when no leg on any rank can still write them (G2);
vLLM is told the request succeeded only when every part from every P rank landed on every D rank and no abort
came; any failed leg fails the request; everything ends quiescent (no fan-in entry, no pending push work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's output aggregator is part of what is checked")

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput

from connector.parallel.ranks import DecodeFanIn, FanInStep, decode_legs
from connector.parallel.topology import heads_of
from connector.plugin import KvpushConnector
from connector.results import Results
from connector.scheduler import Ending, SchedulerHalf
from connector.wire.metadata import PeerAddress, RankId, RankInfo
from connector.worker import WorkerHalf
from tests.compat.outputs import model_runner_output

REQ, HEADS = "d-1", 4
CAN_LAND = {"pending", "quarantined"}


@dataclass
class Leg:
    fate: str  # done | ended | quarantined: how it ends unless cancelled first
    cancel_fate: str  # ended | done: how it ends when cancelled while pending
    state: str = "pending"
    cancelled: bool = False

    def advance(self) -> str | None:
        """The next event of this leg, as the decode machine would report it (None: nothing left)."""
        if self.state == "pending":
            self.state = self.cancel_fate if self.cancelled else self.fate
            return "done" if self.state == "done" else ("quarantined" if self.state == "quarantined" else "ended")
        if self.state == "quarantined":
            self.state = "freed"
            return "freed"
        return None


@dataclass
class Rank:
    fanin: DecodeFanIn
    legs: dict[str, Leg]
    worker: KvpushConnector
    results: Results = field(default_factory=Results)

    def apply(self, step: FanInStep) -> None:  # what TransferThread._fan_in does
        for leg in step.cancel_legs:
            if self.legs[leg].state == "pending":
                self.legs[leg].cancelled = True
        if step.fail_now:
            self.results.failed.add(step.request_id)
        if step.finish:
            self.results.received.add(step.request_id)
            if not step.ok:
                self.results.failed.add(step.request_id)


class _Thread:
    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def kick(self) -> None:
        return None

    def collect_results(self) -> Results:
        r, self.rank.results = self.rank.results, Results()
        return r


def make_worker() -> KvpushConnector:
    worker = WorkerHalf.__new__(WorkerHalf)
    worker._stats = SimpleNamespace(record=lambda *a: None)  # type: ignore[assignment]
    worker._quarantined, worker._lifted, worker._failed, worker._quarantining = set(), set(), set(), set()
    conn = KvpushConnector.__new__(KvpushConnector)
    conn._worker, conn._scheduler = worker, None
    return conn


@dataclass
class Engine:
    ranks: list[Rank]
    sched: KvpushConnector
    aggregator: KVOutputAggregator
    freed_by_vllm: int = 0
    failed_seen: bool = False
    finished_by_vllm: bool = False
    aborted: bool = False
    ever_failed_leg: bool = False

    def step(self) -> None:
        outs = []
        for rank in self.ranks:
            r = rank.worker.get_transfer_results(set())
            out = model_runner_output()  # the fields of the installed vLLM's
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=r.finished_sending or None,
                finished_recving=r.finished_recving or None,
                failed_recving=r.failed_recving,
                kv_connector_worker_meta=rank.worker.build_connector_worker_meta(),
            )
            outs.append(out)
        merged = self.aggregator.aggregate(outs)
        assert merged is not None and merged.kv_connector_output is not None
        kv = merged.kv_connector_output
        half = self.sched._scheduler
        assert half is not None
        if REQ in (kv.failed_recving or ()):
            self.failed_seen = True
            if not self.finished_by_vllm:  # vLLM fails the request (FINISHED_ERROR) before reading the finish
                self.finished_by_vllm = True
                half.request_finished(SimpleNamespace(request_id=REQ, kv_transfer_params=None), [], Ending.ERROR)
        self.sched.update_connector_output(kv)
        if REQ in (kv.finished_recving or ()):
            assert all(leg.state not in CAN_LAND for r in self.ranks for leg in r.legs.values()), "G2"
            self.freed_by_vllm += 1
        for request_id in half.build_connector_meta(None).cancel:  # the step plan reaches every rank
            for rank in self.ranks:
                if request_id in rank.fanin.requests:
                    rank.apply(rank.fanin.on_abort(request_id))

    def abort(self) -> None:
        half = self.sched._scheduler
        assert half is not None
        if not self.finished_by_vllm and self.freed_by_vllm == 0:
            self.aborted = self.finished_by_vllm = True
            half.request_finished(SimpleNamespace(request_id=REQ, kv_transfer_params=None), [], Ending.ABORTED)

    def move(self, r: int, i: int) -> None:
        rank = self.ranks[r % len(self.ranks)]
        name = list(rank.legs)[i % len(rank.legs)]
        event = rank.legs[name].advance()
        if event is None or not rank.fanin.owns(name):
            return
        self.ever_failed_leg |= event in ("ended", "quarantined")
        rank.apply(rank.fanin.on_leg(name, event))


def build(p_tp: int, d_tp: int, fates: list[tuple[str, str]]) -> Engine:
    peer = PeerAddress("P", "h", 5600, tp_size=p_tp)
    ranks = []
    k = 0
    for d in range(d_tp):
        info = RankInfo(d_tp, 1, RankId(0, d), HEADS, heads_of(d, d_tp, HEADS), 16, (0, 1))
        legs = decode_legs(REQ, peer, info)
        fanin = DecodeFanIn()
        fanin.add(REQ, legs)
        leg_state = {}
        for name, _ in legs:
            fate, cancel_fate = fates[k % len(fates)]
            leg_state[name] = Leg(fate, cancel_fate)
            k += 1
        rank = Rank(fanin, leg_state, make_worker())
        rank.worker._worker._thread = _Thread(rank)  # type: ignore[union-attr]
        ranks.append(rank)
    half = SchedulerHalf("d", "h", 5600, tp_size=d_tp)
    half._awaiting.add(REQ)
    sched = KvpushConnector.__new__(KvpushConnector)
    sched._worker, sched._scheduler = None, half
    return Engine(ranks, sched, KVOutputAggregator(expected_finished_count=d_tp))


FATES = st.tuples(st.sampled_from(["done", "done", "ended", "quarantined"]), st.sampled_from(["ended", "done"]))
ACTIONS = st.one_of(
    st.tuples(st.just("move"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.just(0), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(
    tps=st.sampled_from([(n, m) for n in (1, 2, 4) for m in (1, 2, 4)]),  # P_tp < D_tp too (one source each)
    fates=st.lists(FATES, min_size=1, max_size=16),
    actions=st.lists(ACTIONS, max_size=40),
)
def test_random_interleavings_of_n_by_m_ranks_keep_every_guarantee(
    tps: tuple[int, int], fates: list[tuple[str, str]], actions: list[tuple[str, int, int]]
) -> None:
    engine = build(*tps, fates)
    for kind, r, i in actions:
        if kind == "move":
            engine.move(r, i)
        elif kind == "step":
            engine.step()
        else:
            engine.abort()
    for _ in range(12):  # then everything runs to its end: legs land or end, deadlines pass, steps run
        for r, rank in enumerate(engine.ranks):
            for i in range(len(rank.legs)):
                engine.move(r, i)
        engine.step()
    all_done = all(leg.state == "done" for rank in engine.ranks for leg in rank.legs.values())
    assert engine.freed_by_vllm == 1, "vLLM frees the blocks exactly once"
    if engine.ever_failed_leg:
        assert engine.failed_seen, "a failed leg fails the request"
    elif not engine.aborted:
        assert not engine.failed_seen and all_done, "a success is every part from every P rank on every D rank"
    if not engine.failed_seen and not engine.aborted:
        assert all_done, "received only after every part from every P rank landed on every D rank"
    assert all(not rank.fanin.requests and not rank.fanin.leg_of for rank in engine.ranks), "quiescent"
    half = engine.sched._scheduler
    assert half is not None and not half.has_pending_push_work(), "nothing left pending"
