"""Every event counter of the connector reaches exactly one Prometheus series (issue 12)."""

from __future__ import annotations

from collections import Counter

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
