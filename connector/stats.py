"""Transfer statistics through vLLM's connector-stats hooks (shown on /metrics as ``vllm:kvpush_*``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from connector.rendezvous.actions import Tally
from connector.results import TransferRecord

_SERIES = ("transfer_duration", "bytes_transferred", "num_descriptors")
# Run lengths of each WRITE's block ids as (length, count) pairs (``transfer.base.RunShape``): on P, on D, on both.
_RUNS = ("runs_prefill", "runs_decode", "runs_both")

# Prometheus counter (without "vllm:kvpush_" and "_total") -> the connector's event counters it sums.
# Every ``Tally`` member belongs to exactly one series (tests/unit/connector/test_stats.py checks it).
COUNTERS: dict[str, tuple[Tally, ...]] = {
    "completed_transfers": (Tally.WRITTEN, Tally.RECEIVED),
    "failed_transfers": (
        Tally.WRITE_FAILED,
        Tally.FAILED,
        Tally.PEER_LOST,
        Tally.PREFILL_FAILED,
        Tally.MISMATCH,
        Tally.THREAD_ERRORS,
    ),
    "quarantined": (Tally.QUARANTINED, Tally.QUARANTINE_EXPIRED, Tally.RELEASE_REFUSED),
    "expired": (Tally.EXPIRED,),
    "failed_notifications": (Tally.FAILED_NOTICES, Tally.BAD_NOTICES),
    "ignored_notices": (Tally.DUPLICATE, Tally.STALE, Tally.CONFLICT, Tally.UNKNOWN_NOTICES, Tally.LATE_PREFILL),
    "cancelled": (Tally.CANCELLED, Tally.RELEASED, Tally.WRITE_RELEASED),
    "agents_removed": (Tally.AGENTS_REMOVED,),
    "writes_posted": (Tally.WRITES_POSTED,),  # every WRITE; > completed transfers: progressive push (G14)
    "partial_writes": (Tally.PARTIAL_WRITES,),  # WRITEs without Done (a step of a chunked prefill)
    "preemption_fences": (Tally.FENCED,),  # preempted legs whose WRITE the step's forward waited for
    "preemption_fence_timeouts": (Tally.FENCE_TIMEOUTS,),  # ... and went on without (write_timeout_s)
}


def _empty() -> dict[str, Any]:
    return {**{k: [] for k in (*_SERIES, *_RUNS)}, "counters": {}}


@dataclass
class KvpushStats(KVConnectorStats):  # type: ignore[misc]  # vllm is untyped here
    """Per-interval data: one entry per completed WRITE in each series, plus event counters."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def record(self, records: Iterable[TransferRecord], counters: Mapping[str, int]) -> None:
        for r in records:
            self.data["transfer_duration"].append(r.seconds)
            self.data["bytes_transferred"].append(r.num_bytes)
            self.data["num_descriptors"].append(r.num_descriptors)
            for key, lengths in zip(_RUNS, (r.runs.prefill, r.runs.decode, r.runs.both), strict=True):
                self.data[key].extend([n, c] for n, c in lengths)
        for name, n in counters.items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + n

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        for k in (*_SERIES, *_RUNS):
            self.data[k].extend(other.data.get(k, ()))
        for name, n in other.data["counters"].items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["transfer_duration"])
        total_s = sum(self.data["transfer_duration"])
        total_b = sum(self.data["bytes_transferred"])
        out: dict[str, int | float] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(1e3 * total_s / n, 3) if n else 0,
            "Avg MB per transfer": round(total_b / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(total_b / total_s / 2**20, 3) if total_s else 0,
        }
        out.update(self.data["counters"])
        return out

    def is_empty(self) -> bool:
        return not self.data["transfer_duration"] and not self.data["counters"]


class KvpushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = per_engine_labelvalues

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            metric = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            per: dict[int, Any] = create_metric_per_engine(metric, per_engine)
            return per

        self.histograms = {
            "transfer_duration": histogram(
                "vllm:kvpush_xfer_time_seconds",
                "Duration of kvpush KV WRITEs, post to completion.",
                [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
            ),
            "bytes_transferred": histogram(
                "vllm:kvpush_bytes_transferred",
                "Bytes per kvpush KV WRITE.",
                [float(2**k) for k in range(12, 36, 2)],
            ),
            "num_descriptors": histogram(
                "vllm:kvpush_num_descriptors",
                "Descriptors per kvpush KV WRITE.",
                [float(2**k) for k in range(0, 16)],
            ),
        }
        runs_doc = "Runs of consecutive block ids in kvpush KV WRITEs, in blocks, one observation per run"
        run_buckets = [float(2**k) for k in range(0, 13)]
        self.run_histograms = {
            "runs_prefill": histogram("vllm:kvpush_run_blocks_prefill", f"{runs_doc}: on the prefill.", run_buckets),
            "runs_decode": histogram("vllm:kvpush_run_blocks_decode", f"{runs_doc}: on the decode.", run_buckets),
            "runs_both": histogram(
                "vllm:kvpush_run_blocks_both", f"{runs_doc}: on both sides at once (one descriptor).", run_buckets
            ),
        }
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvpush_{name}",
                    documentation=f"kvpush connector events: {', '.join(sources)}.",
                    labelnames=labelnames,
                ),
                per_engine,
            )
            for name, sources in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
        for key, metric in self.run_histograms.items():
            for length, count in transfer_stats_data.get(key, ()):
                for _ in range(count):
                    metric[engine_idx].observe(length)
        counters = transfer_stats_data.get("counters", {})
        for name, sources in COUNTERS.items():
            n = sum(counters.get(s, 0) for s in sources)
            if n:
                self.counters[name][engine_idx].inc(n)
