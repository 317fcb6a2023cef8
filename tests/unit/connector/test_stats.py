"""Every event counter of the connector reaches exactly one Prometheus series (issue 12)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("vllm", reason="connector.stats plugs into vLLM's connector-stats hooks")

from connector.rendezvous.actions import Tally
from connector.stats import COUNTERS, KvpushStats


def test_every_counter_name_reaches_exactly_one_series() -> None:
    mapped = Counter(t for sources in COUNTERS.values() for t in sources)
    assert set(mapped) == set(Tally), f"not on /metrics: {sorted(set(Tally) - set(mapped))}"
    assert all(n == 1 for n in mapped.values()), [t for t, n in mapped.items() if n > 1]


def test_counters_survive_record_and_aggregate_by_name() -> None:
    a, b = KvpushStats(), KvpushStats()
    a.record([], {Tally.RECEIVED: 2})
    b.record([], {"received": 1})
    merged = a.aggregate(b)
    assert merged.reduce()["received"] == 3


def test_run_lengths_reach_the_three_histograms_one_observation_per_run() -> None:
    """A WRITE's runs (on P, on D, on both) survive record, aggregate across workers and reach /metrics."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from connector.results import TransferRecord
    from connector.stats import KvpushPromMetrics
    from connector.transfer.layout import run_shape

    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:  # the metric class with a private registry (children are not registered)
        class Bound(cls):  # type: ignore[misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **{"registry": registry, **kw})

        return Bound

    shape = run_shape((1, 2, 3, 7, 8), (10, 11, 20, 21, 22))  # P: 3+2, D: 2+3, both: 2+1+2
    assert (shape.prefill, shape.decode, shape.both) == (((2, 1), (3, 1)), ((2, 1), (3, 1)), ((1, 1), (2, 2)))
    a, b = KvpushStats(), KvpushStats()
    a.record([TransferRecord(5, 0.1, 3, shape)], {})
    b.record([TransferRecord(1, 0.1, 1, run_shape((4,), (9,)))], {})
    merged = a.aggregate(b)
    metrics = KvpushPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["engine"],
        {0: ["0"]},
    )
    metrics.observe(merged.data, 0)

    def count(name: str, le: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvpush_run_blocks_{name}_bucket", {"engine": "0", "le": le})

    assert registry.get_sample_value("vllm:kvpush_run_blocks_both_count", {"engine": "0"}) == 4
    assert registry.get_sample_value("vllm:kvpush_run_blocks_both_sum", {"engine": "0"}) == 1 + 1 + 2 + 2
    assert (count("both", "1.0"), count("both", "2.0")) == (2, 4)
    assert registry.get_sample_value("vllm:kvpush_run_blocks_prefill_count", {"engine": "0"}) == 3
    assert count("decode", "2.0") == 2 and count("decode", "4.0") == 3
