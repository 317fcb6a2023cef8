from typing import Any

from loadtest.report.readme import machines, render
from loadtest.results import latest, latest_what_if


def row(suite: str, router: str, mode: str, run_id: str, ttft: float, **kw: Any) -> dict[str, Any]:
    dist = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    base: dict[str, Any] = dict(
        suite=suite,
        router=router,
        mode=mode,
        connector="sim",
        qps=2.0,
        concurrency=None,
        input_len=16,
        output_len=4,
        n=10,
        failed=0,
        ttft_ms=dist,
        tpot_ms=dist,
        itl_ms=dist,
        e2e_ms=dist,
        handoff_ms=None,
        req_per_s=1.0,
        git_commit="abc",
        created="x",
        run_id=run_id,
        profile="qwen3-32b-h200",
    )
    base.update(kw)
    return base


def test_latest_keeps_only_the_newest_run_of_a_suite() -> None:
    rows = [
        row("seed-sim", "kvpush", "push", "20260101T000000Z", 1.0),
        row("seed-sim", "kvpush", "push", "20260102T000000Z", 2.0),
        row("overhead", "direct", "direct", "20250101T000000Z", 3.0),
    ]
    assert [r["ttft_ms"]["mean"] for r in latest(rows, "seed-sim")] == [2.0]
    assert latest(rows, "cpu-vllm") == []


def test_each_shown_run_is_labelled_with_the_machine_its_rows_record_not_the_one_rendering() -> None:
    rows = [
        row("seed-sim", "kvpush", "push", "20260101T000000Z", 1.0, machine="Box A, 2 cores"),
        row("seed-sim", "kvpush", "push", "20260102T000000Z", 1.0, machine="Box B, 2 cores"),  # the newest: shown
        row("overhead", "direct", "direct", "20260103T000000Z", 1.0, machine="Box B, 2 cores"),
        row("same-pair", "kvpush", "push", "20250101T000000Z", 1.0),  # from before rows recorded a machine
    ]
    got = machines(rows)
    assert got == (
        "Box B, 2 cores (runs 20260102T000000Z, 20260103T000000Z); "
        "not recorded for 1 older run(s) (rows record it since 2026-12-07)"
    )
    assert "Box A" not in got and f"Machines, as each shown run's rows record them: {got}." in render(rows)


def test_render_puts_pull_over_push_ratios_and_overhead_deltas() -> None:
    rows = [
        row("seed-sim", "kvpush", "push", "r1", 100.0),
        row("seed-sim", "kvpush", "pull", "r1", 250.0),
        row("overhead", "direct", "direct", "r2", 1.0, concurrency=1, qps=None),
        row("overhead", "kvpush", "push", "r2", 2.5, concurrency=1, qps=None, cpu_s_per_1k=1.2, peak_rss_mb=80.0),
    ]
    text = render(rows)
    assert "| 2.0 | 10 | 100.0 / 250.0 |" in text and "**2.50**" in text
    assert "+1.50" in text  # kvpush TTFT p50 minus direct
    assert "No cpu-vllm run yet." in text
    assert "A-priori anatomy of one 16-token request" in text


def test_what_if_runs_stay_out_of_the_headline() -> None:
    apriori = [row("seed-sim", "kvpush", m, "r1", 100.0) for m in ("push", "pull")]
    probe = [
        row("seed-sim", "kvpush", m, "r9", 999.0, profile="whatif-fast-prefill-slow-setup") for m in ("push", "pull")
    ]
    rows = apriori + probe
    assert latest(rows, "seed-sim") == apriori
    assert latest_what_if(rows) == probe
    text = render(rows)
    assert text.index("| 100.0 / 100.0 |") < text.index("### What-if") < text.index("| 999.0 / 999.0 |")


def test_profiling_runs_stay_out_of_the_overhead_tables() -> None:
    full = [row("overhead", "kvpush", "push", "r1", 2.0, concurrency=1, qps=None)]
    prof = [row("overhead", "kvpush", "push", "r2", 9.0, concurrency=1, qps=None, profiling_run=True)]
    assert latest(full + prof, "overhead") == full
