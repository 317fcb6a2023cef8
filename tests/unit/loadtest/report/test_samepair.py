"""The same-pair section of bench/README.md (pure: rows in, Markdown out)."""

from typing import Any

from loadtest.report import readme as report
from loadtest.report import samepair as report_samepair
from tests.unit.loadtest.report.test_targets import cpu_row


def row(router: str, conn: str, qps: float, rep: int, ttft: float, diff: float = 0.0) -> dict[str, Any]:
    paired = {"pairs": 10.0, "diff_p50_ms": diff, "faster_share": 0.7 if diff < 0 else 0.3, "with": "x"}
    return cpu_row(router, conn, qps, rep, ttft, suite="same-pair", run_id="20261201T220000Z", paired_ttft=paired)


ROWS = [
    row("kvpush", "kvpush-push", 1.0, 0, 100.0, diff=-3.0),
    row("vllm-router", "kvpush-push", 1.0, 0, 104.0, diff=3.0),
    row("kvpush", "kvpush-push", 1.0, 1, 140.0, diff=-5.0),  # both fronts drifted together in this repeat
    row("vllm-router", "kvpush-push", 1.0, 1, 139.0, diff=5.0),
    row("kvpush", "upstream-push", 1.0, 0, 120.0),
    row("vllm-router", "upstream-push", 1.0, 0, 110.0),
]


def test_the_target_is_judged_on_the_medians_of_repeats_per_pair() -> None:
    text = "\n".join(report_samepair.section(ROWS))
    assert "Targets met: 3 of 4 judged." in text  # TTFT on one pair of two; TPOT (equal here) on both
    assert "| kvpush TPOT mean <= vllm-router's (kvpush-push pair) | 1 QPS | 8.00 | 8.00 |" in text
    assert "| kvpush TTFT p50 <= vllm-router's (kvpush-push pair) | 1 QPS | 120.00 | 121.50 |" in text
    assert "| kvpush TTFT p50 <= vllm-router's (upstream-push pair) | 1 QPS | 120.00 | 110.00 |" in text
    assert "At once, per repeat on the kvpush-push pair: kvpush's TTFT p50 at or below vllm-router's in 1 of 2" in text
    assert "| 1.0 | kvpush-push | kvpush | 2 | 20 | 0 | 120.0 (100.0-140.0) |" in text


def test_pairs_by_arrival_are_summed_over_the_repeats_per_point() -> None:
    text = "\n".join(report_samepair.section(ROWS))
    assert "| 100 (100-100) | -4.0 (-5.0--3.0) | 14 of 20 (70 %) |" in text  # kvpush's row
    assert "| 100 (100-100) | 4.0 (3.0-5.0) | 6 of 20 (30 %) |" in text  # vllm-router's, mirrored
    assert (
        "Paired by arrival on the kvpush-push pair (kvpush minus vllm-router): 1 QPS -4.0 (-5.0--3.0) ms, "
        "kvpush faster in 14 of 20 (70 %)." in text
    )


def test_the_readme_has_the_section_of_the_latest_run_only() -> None:
    old = [dict(r, run_id="20261201T100000Z", ttft_ms={"p50": 1.0, "mean": 1.0}) for r in ROWS]
    text = report.render([*old, *ROWS])
    assert "## same-pair: kvpush and vllm-router at once on one real push pair" in text
    assert "same-pair 20261201T220000Z" in text and "| 1 QPS | 1.00 |" not in text
    assert "No same-pair run yet." in report.render([])
