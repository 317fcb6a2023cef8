"""bench.point.measure_together on real processes: two routers in front of one simulated pair, loaded at once."""

from pathlib import Path

import pytest

from loadtest.bench.point import Point, measure_together
from loadtest.bench.procs import router_proc, sim_proc, url
from loadtest.results import RowLabels, load_rows
from stack.engines import Fleet, prefill_arg
from stack.procs import free_port

pytestmark = pytest.mark.integration
N, WARMUP, PROMPT = 6, 1, 64


def test_two_fronts_on_one_pair_take_one_stream_together_and_share_the_decodes_kv_count(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    p_port, d_port = free_port(), free_port()
    with Fleet(logs) as fleet:
        fleet.start(sim_proc("sim-p", "prefill", p_port, "zero", "both", logs))
        fleet.start(sim_proc("sim-d", "decode", d_port, "zero", "both", logs))
        spec = prefill_arg(url(p_port), "sim-p", p_port)
        ports = {mode: free_port() for mode in ("push", "pull")}
        for mode, port in ports.items():
            fleet.start(router_proc(f"router-{mode}", port, mode, spec, url(d_port), logs))
        fleet.wait_all_healthy(timeout=60.0)
        points = [
            Point(
                RowLabels("same-pair", "kvpush", mode, "sim", 4.0, None, PROMPT, 4),
                url(port),
                N,
                seed=10,
                warmup=WARMUP,
                router_timings=True,
                decode_url=url(d_port),
                stride=2,
                phase=k,
                salt=101 + k,
                extra={"repeat": 0},
            )
            for k, (mode, port) in enumerate(ports.items())
        ]
        rows = measure_together(points, tmp_path, tmp_path / "summary.json", progress=False)
    assert load_rows(tmp_path / "summary.json") == rows  # one row per front, appended once
    assert [(r["mode"], r["n"], r["failed"]) for r in rows] == [("push", N, 0), ("pull", N, 0)]
    for r in rows:
        assert r["handoff_ms"] is not None  # each front's own router timings were joined
        assert r["kv_sources"] == "shared" and r["kv_external_frac"] == 1.0
        # D's count covers both fronts' requests (warm-ups included): it was read once around both loads
        assert r["decode_prompt_tokens_by_source"]["external_kv_transfer"] == 2 * (N + WARMUP) * PROMPT
    push, pull = rows
    # the two took one stream in turn: request j of each is paired with the other's
    assert push["paired_ttft"]["with"] == "kvpush" and push["paired_ttft"]["pairs"] == N
    assert push["paired_ttft"]["diff_p50_ms"] == pytest.approx(-pull["paired_ttft"]["diff_p50_ms"])
    # the loads overlapped in time: each began before the other ended
    assert push["load_started_unix"] < pull["load_started_unix"] + pull["load_s"]
    assert pull["load_started_unix"] < push["load_started_unix"] + push["load_s"]
