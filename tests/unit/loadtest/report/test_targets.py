"""Target verdicts and repeat aggregation of the bench report (pure: rows in, Markdown out)."""

import json
from pathlib import Path
from typing import Any

from loadtest.report import cpu as report_cpu
from loadtest.report import overhead as report_overhead
from loadtest.report import seed as report_seed
from loadtest.report.kit import Verdict, agg, verdict_table


def dist(v: float) -> dict[str, float]:
    return {"mean": v, "p50": v, "p90": v, "p99": v}


def cpu_row(router: str, conn: str, qps: float, rep: int, ttft: float, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "suite": "cpu-vllm",
        "router": router,
        "mode": "pull" if conn == "upstream-pull" else "push",
        "connector": conn,
        "qps": qps,
        "repeat": rep,
        "n": 10,
        "failed": 0,
        "ttft_ms": dist(ttft),
        "tpot_ms": dist(8.0),
        "handoff_ms": dist(ttft / 4),
        "req_per_s": 1.0,
        "kv_external_frac": 1.0,
        "input_len": 1024,
        "output_len": 64,
        "model": "bench",
    }
    row.update(kw)
    return row


def test_agg_is_median_min_max_over_repeats() -> None:
    rows = [cpu_row("kvpush", "kvpush-push", 1.0, i, t) for i, t in enumerate((100.0, 300.0, 200.0))]
    a = agg(rows, "ttft_ms", "mean")
    assert a is not None and (a.med, a.lo, a.hi, a.k) == (200.0, 100.0, 300.0, 3)
    assert a.spread == 1.0 and a.text(0) == "200 (100-300)"


def test_verdicts_say_met_or_missed_and_by_how_much() -> None:
    v = Verdict("x", "p", ours=90.0, ref=100.0, limit=85.0)
    assert v.met is False and "5.00 ms (6 %) over" in v.cells()[-1]
    higher = Verdict("req/s", "p", ours=2.0, ref=1.5, limit=1.5, lower_is_better=False, unit="req/s")
    assert higher.met is True and "inside" in higher.cells()[-1]
    assert Verdict("x", "p", None, 1.0, 1.0).met is None
    assert "Targets met: 1 of 2 judged." in verdict_table([v, higher])


def test_issue8_uses_0_85x_from_3_qps_and_medians_of_repeats() -> None:
    rows = []
    for rep in (0, 1):
        rows += [
            cpu_row("kvpush", "kvpush-push", 1.0, rep, 99.0),
            cpu_row("kvpush", "upstream-push", 1.0, rep, 100.0),
            cpu_row("kvpush", "upstream-pull", 1.0, rep, 100.0),
            cpu_row("kvpush", "kvpush-push", 3.0, rep, 90.0 if rep else 80.0),  # median 85
            cpu_row("kvpush", "upstream-push", 3.0, rep, 100.0),
            cpu_row("kvpush", "upstream-pull", 3.0, rep, 100.0),
        ]
    vs = {(v.target, v.point): v for v in report_cpu.connector_verdicts(rows)}
    assert vs[("TTFT p50 <= 1x upstream push", "1 QPS")].met
    three = vs[("TTFT p50 <= 0.85x upstream push", "3 QPS")]
    assert three.ours == 85.0 and three.limit == 85.0 and three.met
    assert ("handoff p50 <= 0.5x upstream push", "1 QPS") not in vs  # only at 3 QPS and above
    assert vs[("handoff p50 <= 0.5x upstream push", "3 QPS")].met is False  # 21.25 vs 0.5 x 25
    assert vs[("100 % KV by transfer (worst repeat)", "3 QPS")].met


def test_issue41_judges_push_tpot_against_pull_and_the_front_against_vllm_router_at_every_point() -> None:
    rows = [
        cpu_row("kvpush", "kvpush-push", 1.5, 0, 90.0, tpot_ms=dist(10.5)),
        cpu_row("kvpush", "upstream-push", 1.5, 0, 100.0, tpot_ms=dist(10.5)),
        cpu_row("kvpush", "upstream-pull", 1.5, 0, 200.0, tpot_ms=dist(8.1)),
        cpu_row("kvpush", "kvpush-push", 8.0, 0, 90.0, tpot_ms=dist(7.0)),
        cpu_row("kvpush", "upstream-push", 8.0, 0, 100.0, tpot_ms=dist(9.0)),
        cpu_row("kvpush", "upstream-pull", 8.0, 0, 200.0, tpot_ms=dist(10.4)),
        cpu_row("vllm-router", "kvpush-push", 8.0, 0, 95.0, tpot_ms=dist(6.5)),
    ]
    vs = {(v.target, v.point): v for v in report_cpu.connector_verdicts(rows)}
    assert vs[("TPOT mean <= pull", "1.5 QPS")].met is False, "10.5 ms against pull's 8.1"
    assert vs[("TPOT mean <= pull", "8 QPS")].met is True
    (tpot,) = [v for v in report_cpu.router_verdicts(rows) if v.target.startswith("kvpush TPOT")]
    assert tpot.met is False and tpot.ref == 6.5


def test_issue9_compares_fronts_on_the_same_pair() -> None:
    rows = [
        cpu_row("kvpush", "upstream-push", 3.0, 0, 120.0),
        cpu_row("vllm-router", "upstream-push", 3.0, 0, 110.0),
        cpu_row("kvpush", "kvpush-push", 3.0, 0, 100.0),
        cpu_row("vllm-router", "kvpush-push", 3.0, 0, 105.0),
    ]
    vs = {v.target: v for v in report_cpu.router_verdicts(rows)}
    assert vs["kvpush TTFT p50 <= vllm-router's (upstream-push pair)"].met is False
    assert vs["kvpush TTFT p50 <= vllm-router's (kvpush-push pair)"].met is True
    text = "\n".join(report_cpu.cpu_section(rows))
    assert "Issue 8 targets" in text and "Issue 9 target" in text


def test_issue9_is_also_counted_within_each_repeat() -> None:
    rows = [
        cpu_row("kvpush", "kvpush-push", 1.0, 0, 90.0),
        cpu_row("vllm-router", "kvpush-push", 1.0, 0, 100.0),
        cpu_row("kvpush", "kvpush-push", 1.0, 1, 150.0),  # a drifted repeat: both fronts slower, ours more
        cpu_row("vllm-router", "kvpush-push", 1.0, 1, 120.0),
        cpu_row("kvpush", "kvpush-push", 3.0, 0, 100.0),
        cpu_row("vllm-router", "kvpush-push", 3.0, 0, 100.0),
        cpu_row("kvpush", "upstream-pull", 1.0, 0, 200.0),  # pull rows are not paired
    ]
    (line,) = report_cpu.paired_lines(rows)
    assert line.startswith("Paired within each repeat on the kvpush-push pair: kvpush's TTFT p50 at or below")
    assert "in 2 of 3 (" in line and "1 QPS 0.90 / 1.25; 3 QPS 1.00" in line
    assert line in report_cpu.cpu_section(rows)


def over_row(router: str, mode: str, conc: int, rep: int, ttft: float, **kw: Any) -> dict[str, Any]:
    row = cpu_row(router, "sim", 0.0, rep, ttft, suite="overhead", concurrency=conc, mode=mode, **kw)
    row["qps"] = None
    return row


def test_overhead_targets_use_added_latency_over_direct() -> None:
    rows = []
    for rep in range(3):
        rows += [
            over_row("direct", "direct", 1, rep, 1.0),
            over_row("kvpush", "push", 1, rep, 2.1, cpu_s_per_1k=1.0, req_per_s=400.0),
            over_row("vllm-router", "push", 1, rep, 2.0, cpu_s_per_1k=0.5, req_per_s=500.0),
            over_row("direct", "direct", 64, rep, 10.0),
            over_row("kvpush", "push", 64, rep, 30.0, cpu_s_per_1k=1.0),
            over_row("vllm-router", "push", 64, rep, 40.0, cpu_s_per_1k=0.5),
        ]
    vs = {(v.target, v.point): v for v in report_overhead.verdicts(rows)}
    c1 = vs[("added TTFT p50 <= vllm-router push + 0.2 ms", "c=1")]
    assert abs((c1.ours or 0) - 1.1) < 1e-9 and c1.met  # +1.1 vs +1.0 + 0.2
    assert vs[("CPU / 1k req <= 1.0x vllm-router push", "c=64")].met is False
    assert vs[("max req/s >= vllm-router push", "all levels")].met is False
    assert vs[("added TTFT p99 <= vllm-router push", "c=64")].met is True
    profiled = [over_row("kvpush", "push", 1, 0, 99.0, profiled=True)]
    text = "\n".join(report_overhead.overhead_section(rows + profiled))
    assert "99.00" not in text  # profiled rows stay out of the tables and targets


def test_an_old_kvpush_row_on_the_deleted_aiohttp_legs_is_its_own_row_and_stays_out_of_the_targets() -> None:
    rows = []
    for rep in range(3):
        rows += [
            over_row("direct", "direct", 1, rep, 1.0),
            over_row("kvpush", "push", 1, rep, 2.1, cpu_s_per_1k=1.0, leg_client="http1"),
            over_row("kvpush", "push", 1, rep, 9.0, cpu_s_per_1k=7.0, leg_client="aiohttp"),
            over_row("vllm-router", "push", 1, rep, 2.0, cpu_s_per_1k=0.5),
        ]
    vs = {(v.target, v.point): v for v in report_overhead.verdicts(report_overhead._scored(rows))}
    assert vs[("CPU / 1k req <= 1.0x vllm-router push", "c=1")].ours == 1.0  # the default client's, not a mix
    text = "\n".join(report_overhead.table(report_overhead._scored(rows)))
    assert "| kvpush (aiohttp legs) | push | 3 |" in text and "| kvpush | push | 3 |" in text


def test_calibration_section_names_the_missing_mechanism(tmp_path: Path) -> None:
    stats = {"ttft_mean_ms": 1600.0, "ttft_p50_ms": 1600.0, "tpot_mean_ms": 10.0, "handoff_p50_ms": 100.0}
    data = {
        "target_pull": {"ttft_mean_ms": 1744.0, "tpot_mean_ms": 10.4},
        "target_push": {"ttft_mean_ms": 540.0, "tpot_mean_ms": 7.0},
        "qps": 8.0,
        "prompt": 16384,
        "output": 256,
        "fitted": {"efficiency.mfu": 1.3},
        "apriori": {"efficiency.mfu": 0.5},
        "bounded": [],
        "error": 0.01,
        "evaluations": 10,
        "pull": stats,
        "predicted": {m: stats for m in ("pull", "upstream-push", "kvpush-push", "kvpush-progressive")},
        "apriori_predicted": {m: stats for m in ("pull", "upstream-push", "kvpush-push", "kvpush-progressive")},
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    text = "\n".join(report_seed.calibration_section(path))
    assert "FITTED: `efficiency.mfu` = 1.3 (a-priori 0.5)" in text
    assert "cannot reproduce both rows" in text and "2.96x" in text


def test_mdl_service_time_inverts_the_waiting_time() -> None:
    s = report_seed.mdl_service_s(1.0, 8.0)
    assert abs(8.0 * s * s / (2 * (1 - 8.0 * s)) - 1.0) < 1e-9
