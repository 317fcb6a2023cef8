"""Tiny versions of the benchmark suites, run for real (simulator processes, the real router, vllm-router)."""

import importlib.util
import json
from pathlib import Path

import pytest

from loadtest.bench.aslr import fixed_layout
from loadtest.bench.procs import vrouter_binary
from loadtest.bench.run import run_suites
from loadtest.results import REQUIRED

pytestmark = pytest.mark.integration

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("router") is None, reason="the router package is not importable yet"
)


def rows_of(results: Path) -> list[dict[str, object]]:
    rows = json.loads((results / "summary.json").read_text())
    assert isinstance(rows, list)
    for row in rows:
        assert set(REQUIRED) <= set(row)
    return rows


@needs_router
def test_seed_sim_smoke_push_and_pull_through_the_router(tmp_path: Path) -> None:
    assert run_suites("seed-sim", smoke=True, results=tmp_path, progress=False) == 0
    rows = rows_of(tmp_path)
    stacks = [("pull", "sim"), ("push", "kvpush-progressive"), ("push", "kvpush-push"), ("push", "upstream-push")]
    assert len(rows) == 8
    assert {(r["qps"], r["mode"], r["connector"]) for r in rows} == {(q, *s) for q in (1.0, 2.0) for s in stacks}
    for r in rows:
        assert r["failed"] == 0, r["errors"]
        assert r["router"] == "kvpush"
        assert r["handoff_ms"] is not None  # the router measured every handoff
        assert r["kv_external_frac"] == 1.0  # decode got all its prompt tokens by (simulated) transfer
    for name in ("seed-sim.png", "seed-sim-ttft-cdf.png", "seed-sim-handoff-cdf.png", "README.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert "ours / upstream TTFT mean" in (tmp_path / "README.md").read_text()


@needs_router
def test_overhead_smoke_has_direct_kvpush_and_vllm_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With tracing (and its A/A control) too: the push routers are started afresh for the second level, each
    kvpush point reads its router's threads, and a traced router's export thread is seen working."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # a traced point then waits 1.2 s for its spans' export
    tracings = ["tracings=off,control,1"]
    assert run_suites("overhead", smoke=True, results=tmp_path, progress=False, overrides=tracings) == 0
    rows = rows_of(tmp_path)
    fronts = {(r["router"], r["mode"]) for r in rows}
    assert {("direct", "direct"), ("kvpush", "push"), ("kvpush", "pull")} <= fronts
    push = [r for r in rows if r["router"] == "kvpush" and r["mode"] == "push"]
    assert sorted(str(r["tracing"]) for r in push) == ["1", "1", "control", "control", "off", "off"]
    with fixed_layout() as fixed:  # the run's processes started with ASLR off where the kernel allows it
        assert {r["layout"] for r in rows} == {"fixed" if fixed else "random"}
    for r in push:
        assert float(str(r["loop_thread_us_per_req"])) > 0, r
        if r["tracing"] == "1":
            assert float(str(r["side_threads_us_per_req"])) > 0, r  # the export thread's work is counted
    if vrouter_binary() is not None:
        assert {("vllm-router", "pull"), ("vllm-router", "push")} <= fronts
    for r in rows:
        assert r["failed"] == 0, (r["router"], r["mode"], r["errors"])
        if r["router"] != "direct":
            assert r["cpu_s_per_1k"] is not None and float(str(r["peak_rss_mb"])) > 0
            # the workers saw how the legs came: push fronts never handed D the prefill's block ids
            wire = r["wire_order"]
            assert isinstance(wire, dict)
            kinds = wire["d_kinds"]
            assert set(kinds) == {r["mode"]}, (r["router"], r["mode"], kinds)


@needs_router
def test_overhead_can_profile_the_push_router(tmp_path: Path) -> None:
    assert run_suites("overhead", smoke=True, results=tmp_path, progress=False, overrides=["cprofile=true"]) == 0
    prof = json.loads((tmp_path / "router-profile.json").read_text())
    assert prof["requests"] > 0 and prof["total_s"] > 0
    assert "legs: upstream client" in prof["per_request_ms"]
