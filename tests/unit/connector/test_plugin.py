"""connector.plugin: the quarantine through vLLM's own worker-output aggregator, and the DP side-channel index.

A quarantined receive must reach vLLM's scheduler as a failure in the step it happens (vLLM 0.32's
``KVOutputAggregator`` passes ``failed_recving`` only with ``finished_recving``), while the finish is
withheld so vLLM keeps the blocks until the hold deadline (G2, G3). Guarantee numbers: connector/README.md.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="connector.plugin is the class vLLM loads")

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput

from connector.plugin import KvpushConnector, KvpushWorkerMeta, _dp_index
from connector.scheduler import Ending, SchedulerHalf
from connector.transfer_thread import Results
from connector.wire.metadata import RankId
from connector.worker import WorkerHalf
from tests.compat.outputs import model_runner_output


class _Thread:
    """Stands in for the transfer thread: hands out the results queued by the test."""

    def __init__(self) -> None:
        self.queued = Results()

    def kick(self) -> None:
        return None

    def collect_results(self) -> Results:
        r, self.queued = self.queued, Results()
        return r


def _worker() -> tuple[KvpushConnector, _Thread]:
    worker = WorkerHalf.__new__(WorkerHalf)  # the test needs no KV caches, only the result relay
    thread = _Thread()
    worker._thread = thread  # type: ignore[assignment]
    worker._stats = SimpleNamespace(record=lambda *a: None)  # type: ignore[assignment]
    worker._quarantined, worker._lifted, worker._failed, worker._quarantining = set(), set(), set(), set()
    conn = KvpushConnector.__new__(KvpushConnector)
    conn._worker, conn._scheduler = worker, None
    return conn, thread


def _scheduler(request_id: str, tp_size: int = 1) -> KvpushConnector:
    half = SchedulerHalf("d", "127.0.0.1", 5600, tp_size=tp_size)
    half._awaiting.add(request_id)  # registered in an earlier step
    conn = KvpushConnector.__new__(KvpushConnector)
    conn._worker, conn._scheduler = None, half
    return conn


def _step(worker: KvpushConnector, aggregator: KVOutputAggregator, *more: KvpushConnector) -> KVConnectorOutput:
    """One engine step as vLLM's model runner and MultiprocExecutor produce it (``more``: the other ranks)."""
    outs = []
    for rank in (worker, *more):
        r = rank.get_transfer_results(set())
        out = model_runner_output()  # the fields of the installed vLLM's
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=r.finished_sending or None,
            finished_recving=r.finished_recving or None,
            failed_recving=r.failed_recving,
            kv_connector_worker_meta=rank.build_connector_worker_meta(),
        )
        outs.append(out)
    merged = aggregator.aggregate(outs)
    assert merged is not None and merged.kv_connector_output is not None
    kv_output: KVConnectorOutput = merged.kv_connector_output
    return kv_output


def test_a_quarantine_fails_the_request_now_and_frees_its_blocks_only_at_the_hold_deadline() -> None:
    worker, thread = _worker()
    sched = _scheduler("d-1")
    aggregator = KVOutputAggregator(expected_finished_count=1)
    thread.queued.failed.add("d-1")  # link lost: Failed (quarantine)
    out = _step(worker, aggregator)
    assert out.failed_recving == {"d-1"}, "vLLM must fail the request in this step"
    assert sched._scheduler is not None
    sched._scheduler.request_finished(SimpleNamespace(request_id="d-1", kv_transfer_params=None), [], Ending.ERROR)
    sched.update_connector_output(out)
    assert not out.finished_recving, "vLLM would free the quarantined blocks now"
    assert sched.has_pending_push_work()
    assert not _step(worker, aggregator).finished_recving, "nothing until the deadline"
    thread.queued.received.add("d-1")  # hold deadline: Freed
    out = _step(worker, aggregator)
    assert out.failed_recving == set()
    sched.update_connector_output(out)
    assert out.finished_recving == {"d-1"}, "the deadline's finish frees the blocks"
    assert not sched.has_pending_push_work()


def test_a_plain_failure_is_failed_and_freed_in_one_step() -> None:
    worker, thread = _worker()
    sched = _scheduler("d-2")
    thread.queued.received.add("d-2")
    thread.queued.failed.add("d-2")  # Received(ok=False): P released its handle, nothing can land
    out = _step(worker, KVOutputAggregator(expected_finished_count=1))
    sched.update_connector_output(out)
    assert (out.failed_recving, out.finished_recving) == ({"d-2"}, {"d-2"})


def test_worker_metadata_sums_counts_over_ranks() -> None:
    mine = KvpushWorkerMeta(Counter({"a": 1}), Counter({"c": 1}), frozenset({"a"}))
    merged = mine.aggregate(KvpushWorkerMeta(Counter({"a": 1, "b": 1}), None, frozenset({"b"})))
    assert isinstance(merged, KvpushWorkerMeta)
    assert (merged.quarantined, merged.lifted, merged.failed) == (
        Counter({"a": 2, "b": 1}),
        Counter({"c": 1}),
        frozenset({"a", "b"}),
    )


def test_under_tp_a_quarantine_on_one_rank_while_the_other_got_its_done_frees_exactly_once() -> None:
    """Research turn3-tp 2.1 row 13: ranks that end a request differently. Rank 0 quarantines (failed and finished
    now), rank 1 received its Done: vLLM fails the request, keeps the blocks while rank 0's WRITE may land, and
    frees them once rank 0 lifts its quarantine at the hold deadline (before: that second finish came from one
    rank only and vLLM's per-rank count never completed it: blocks leaked, the engine never idled)."""
    (w0, t0), (w1, t1) = _worker(), _worker()
    sched = _scheduler("d-1", tp_size=2)
    assert sched._scheduler is not None
    aggregator = KVOutputAggregator(expected_finished_count=2)
    t0.queued.failed.add("d-1")  # rank 0: link lost, quarantined
    out = _step(w0, aggregator, w1)
    sched.update_connector_output(out)
    assert sched._scheduler.build_connector_meta(None).cancel == ["d-1"], "a cancel reaches every rank at once"
    t1.queued.received.add("d-1")  # rank 1: its part landed (or its cancel was acknowledged)
    out = _step(w0, aggregator, w1)
    assert out.failed_recving == {"d-1"}, "vLLM fails the request once every rank finished"
    sched._scheduler.request_finished(SimpleNamespace(request_id="d-1", kv_transfer_params=None), [], Ending.ERROR)
    sched.update_connector_output(out)
    assert not out.finished_recving, "rank 0's WRITE may still land: blocks held"
    assert sched.has_pending_push_work()
    t0.queued.received.add("d-1")  # rank 0's hold deadline: Freed
    out = _step(w0, aggregator, w1)
    sched.update_connector_output(out)
    assert out.finished_recving == {"d-1"} and not out.failed_recving
    assert not sched.has_pending_push_work()
    out = _step(w0, aggregator, w1)
    sched.update_connector_output(out)
    assert not out.finished_recving, "finished exactly once"


def test_the_side_channel_index_is_the_data_parallel_index_not_the_reset_rank() -> None:
    """vLLM 0.32 resets data_parallel_rank to 0 for dense-model DP ranks (connector.kvcache.side_channel_port)."""
    assert _dp_index(SimpleNamespace(data_parallel_index=3, data_parallel_rank=0)) == 3
    assert _dp_index(SimpleNamespace(data_parallel_rank=2)) == 2


def _tp_worker(tp: int, rank: int) -> WorkerHalf:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}, kv_buffer_device="cpu"),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 4),
    )
    return WorkerHalf(config, "p0", "127.0.0.1", 5610, rank=RankId(0, rank))


def test_each_tp_worker_listens_on_its_rank_port_and_describes_its_heads() -> None:
    assert [_tp_worker(4, r)._side_port for r in range(4)] == [5610, 5611, 5612, 5613]
    caches = SimpleNamespace(
        geometry=SimpleNamespace(layout="LBHNC", num_heads=2, block_len=2048, page_bytes=2048), layers=("l0", "l1")
    )
    info = _tp_worker(2, 1)._rank_info(caches)  # type: ignore[arg-type]
    assert (info.tp_size, info.rank, info.num_kv_heads, info.heads, info.head_bytes) == (
        2,
        RankId(0, 1),
        4,
        (2, 3),
        1024,
    )
    padded = SimpleNamespace(
        geometry=SimpleNamespace(layout="LBHNC", num_heads=2, block_len=2560, page_bytes=2048), layers=("l0",)
    )
    assert _tp_worker(2, 0)._rank_info(padded).head_bytes == 0, "padded pages: whole blocks only"  # type: ignore[arg-type]
