"""The exemplar gate (router/tracing/exemplars.py) and Metrics.observe: a traced observation sets its bucket's
exemplar at most once per interval; the first one of the interval stays (without the gate, every traced
observation replaced it: prometheus_client's work per observation at 100 % sampling)."""

from __future__ import annotations

from prometheus_client.openmetrics.exposition import generate_latest

from router.metrics import Metrics
from router.tracing.exemplars import ExemplarGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ex(n: int) -> dict[str, str]:
    return {"trace_id": f"{n:032x}", "span_id": f"{n:016x}"}


def test_one_exemplar_per_bucket_and_series_per_interval() -> None:
    clock = Clock()
    gate = ExemplarGate((0.1, 1.0), interval_s=1.0, clock=clock)
    a, b = object(), object()
    assert gate.admit(a, 0.05)
    assert not gate.admit(a, 0.07)  # same bucket (le 0.1), same second
    assert gate.admit(a, 0.1) is False  # a value on the bound is in that bucket too
    assert gate.admit(a, 0.5)  # another bucket
    assert gate.admit(a, 5.0)  # +Inf
    assert gate.admit(b, 0.05)  # another series
    clock.now += 0.999
    assert not gate.admit(a, 0.05)
    clock.now += 0.001
    assert gate.admit(a, 0.05)  # a second later: refreshed
    assert gate.admitted == 5


def test_traced_observations_in_one_bucket_set_its_exemplar_once_a_second() -> None:
    metrics = Metrics(exemplars=True)
    clock = Clock()
    metrics.exemplar_gate = ExemplarGate((0.005, 0.01, 0.025, 0.05, 0.1), clock=clock)
    child = metrics.child(metrics.ttft, "/v1/completions", "push")
    for n in range(1, 101):
        metrics.observe(child, 0.02, ex(n))
    metrics.observe(child, 0.02, None)  # an unsampled request: observed, no exemplar
    page = generate_latest(metrics.registry).decode()  # type: ignore[no-untyped-call]
    lines = [line for line in page.splitlines() if line.startswith("kvpush_ttft_seconds_bucket") and "#" in line]
    assert len(lines) == 1 and f'trace_id="{1:032x}"' in lines[0]  # the first of the second, not the 100th
    assert 'le="0.025"' in lines[0]
    assert metrics.exemplar_gate.admitted == 1
    assert 'kvpush_ttft_seconds_count{endpoint="/v1/completions",mode="push"} 101.0' in page
    clock.now += 1.0
    metrics.observe(child, 0.02, ex(500))
    page = generate_latest(metrics.registry).decode()  # type: ignore[no-untyped-call]
    assert f'trace_id="{500:032x}"' in page
