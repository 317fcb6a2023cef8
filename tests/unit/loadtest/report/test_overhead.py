"""The overhead report's fronts: an old run's kvpush row on the deleted HTTP server (granian) or leg client
(aiohttp) is its own row (pure)."""

from typing import Any

from loadtest.report import overhead as report_overhead
from tests.unit.loadtest.report.test_targets import over_row


def test_an_old_kvpush_row_on_another_server_is_its_own_row_and_stays_out_of_the_targets() -> None:
    rows: list[dict[str, Any]] = []
    for rep in range(2):
        rows += [
            over_row("direct", "direct", 1, rep, 1.0),
            over_row("kvpush", "push", 1, rep, 2.1, cpu_s_per_1k=1.0, leg_client="http1", server="uvicorn"),
            over_row("kvpush", "push", 1, rep, 9.0, cpu_s_per_1k=7.0, leg_client="http1", server="granian"),
            over_row("kvpush", "push", 1, rep, 8.0, cpu_s_per_1k=6.0, leg_client="aiohttp", server="granian"),
            over_row("vllm-router", "push", 1, rep, 2.0, cpu_s_per_1k=0.5),
        ]
    scored = report_overhead._scored(rows)
    vs = {(v.target, v.point): v for v in report_overhead.verdicts(scored)}
    assert vs[("CPU / 1k req <= 1.0x vllm-router push", "c=1")].ours == 1.0  # uvicorn's row only
    text = "\n".join(report_overhead.table(scored))
    assert "| kvpush | push | 2 |" in text
    assert "| kvpush (granian) | push | 2 |" in text
    assert "| kvpush (granian, aiohttp legs) | push | 2 |" in text


def test_rows_without_a_server_field_are_the_default_front() -> None:
    row = over_row("kvpush", "push", 1, 0, 2.0, leg_client="http1")
    assert report_overhead._scored([row])[0]["router"] == "kvpush"


def test_a_point_whose_leg_logs_were_unreadable_shows_no_wire_order() -> None:
    rows = [over_row("direct", "direct", 1, 0, 1.0), over_row("kvpush", "push", 1, 0, 2.0, wire_order=None)]
    line = next(t for t in report_overhead.table(rows) if "| kvpush |" in t)
    assert line.endswith("| - |")


def test_traced_fronts_are_their_own_rows_and_get_the_tracing_table() -> None:
    rows: list[dict[str, Any]] = []
    for rep in range(2):
        rows += [
            over_row("direct", "direct", 1, rep, 1.0),
            over_row("kvpush", "push", 1, rep, 2.0, cpu_s_per_1k=1.0, tracing="off"),
            over_row("kvpush", "push", 1, rep, 2.5, cpu_s_per_1k=1.1, tracing="1"),
            over_row("kvpush", "push", 1, rep, 2.1, cpu_s_per_1k=1.01, tracing="0.01"),
        ]
    scored = report_overhead._scored(rows)
    text = "\n".join(report_overhead.table(scored))
    assert "| kvpush (tracing 100 %) | push | 2 |" in text and "| kvpush (tracing 1 %) | push | 2 |" in text
    vs = {(v.target, v.point): v for v in report_overhead.verdicts(scored)}
    assert vs[("CPU / 1k req <= 1.0x vllm-router push", "c=1")].ours == 1.0  # the untraced router only
    lines = report_overhead.tracing_lines(rows)
    assert "| 1 | 100 % | 1.10 (1.10 to 1.10) | +10.0 % | +10.0 % (+10.0 to +10.0) | - | +0.50 |" in lines
    assert "| 1 | 1 % | 1.01 (1.01 to 1.01) | +1.0 % | +1.0 % (+1.0 to +1.0) | - | +0.10 |" in lines
    assert report_overhead.tracing_lines([r for r in rows if r.get("tracing") == "off"]) == []


def test_the_tracing_table_pairs_each_repeat_with_the_untraced_front_of_the_same_repeat() -> None:
    """The box's load drifts over a run; each repeat's traced front is compared with its own untraced neighbour
    (+10 %, +15 %, +0 % here), where medians across the run say +0 %."""
    rows: list[dict[str, Any]] = []
    for rep, (off, on) in enumerate(((1.0, 1.1), (2.0, 2.3), (1.5, 1.5))):
        rows += [
            over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=off, tracing="off"),
            over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=on, tracing="1"),
        ]
    line = next(x for x in report_overhead.tracing_lines(rows) if x.startswith("| 64 | 100 % |"))
    assert "| +0.0 % | +10.0 % (+0.0 to +15.0) |" in line


def test_the_tracing_table_shows_the_routers_cpu_off_its_event_loop() -> None:
    rows: list[dict[str, Any]] = []
    for rep, side in enumerate((50.0, 60.0, 55.0)):
        rows += [
            {
                **over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=1.0, tracing="off"),
                "side_threads_us_per_req": 0.1,
            },
            {
                **over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=1.1, tracing="1"),
                "side_threads_us_per_req": side,
            },
        ]
    lines = report_overhead.tracing_lines(rows)
    assert next(x for x in lines if x.startswith("| 64 | 100 % |")).endswith("| 55.0 | +0.00 |")
    assert next(x for x in lines if x.startswith("| 64 | off |")).endswith("| 0.1 | - |")


def test_a_tracing_run_stays_out_of_the_latest_overhead_run_and_feeds_its_own_table() -> None:
    from loadtest.results import latest, latest_tracing

    full = [{**over_row("kvpush", "push", 1, 0, 2.0, cpu_s_per_1k=1.0), "run_id": "20261204T100000Z"}]
    traced = [
        {**over_row("kvpush", "push", 1, 0, 2.0, cpu_s_per_1k=1.0, tracing=t), "run_id": "20261204T170000Z"}
        for t in ("off", "1")
    ]
    for row in traced:
        row["tracing_run"] = True
    assert latest([*full, *traced], "overhead") == full
    assert latest_tracing([*full, *traced]) == traced
    assert "Run 20261204T170000Z" in "\n".join(report_overhead.overhead_section(full, None, traced))


def test_the_tracing_table_shows_the_routers_cpu_per_thread_and_pairs_the_threads_sum() -> None:
    rows: list[dict[str, Any]] = []
    for rep, (off_loop, on_loop) in enumerate(((1000.0, 1040.0), (1200.0, 1200.0), (900.0, 1000.0))):
        rows += [
            {
                **over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=1.0, tracing="off"),
                "side_threads_us_per_req": 0.0,
                "loop_thread_us_per_req": off_loop,
            },
            {
                **over_row("kvpush", "push", 64, rep, 2.0, cpu_s_per_1k=1.1, tracing="1"),
                "side_threads_us_per_req": 60.0,
                "loop_thread_us_per_req": on_loop,
            },
        ]
    lines = report_overhead.tracing_lines(rows)
    on = next(x for x in lines if x.startswith("| 64 | 100 % | 1040.0"))
    # loop 1040 (1000-1200), off-loop 60, sum 1100 (1060-1260); paired sums: +10 %, +5 %, +17.8 %
    assert (
        on == "| 64 | 100 % | 1040.0 (1000.0-1200.0) | 60.0 (60.0-60.0) | 1100.0 (1060.0-1260.0) | "
        "+10.0 % (+5.0 to +17.8) |"
    )
    assert "| 64 | off | 1000.0 (900.0-1200.0) | 0.0 (0.0-0.0) | 1000.0 (900.0-1200.0) | - |" in lines


def test_the_per_thread_table_is_left_out_for_rows_without_the_loop_figure() -> None:
    rows = [over_row("kvpush", "push", 64, 0, 2.0, cpu_s_per_1k=1.0, tracing=t) for t in ("off", "1")]
    assert not any(x.startswith("| conc | tracing | loop thread |") for x in report_overhead.tracing_lines(rows))


def test_the_a_a_control_is_shown_as_untraced_with_its_own_paired_difference() -> None:
    """`control`, a second untraced router, is not a sample ratio: it gets its own row in both tracing tables
    (the noise floor), and the main table names it as a control, not a tracing percentage."""
    rows: list[dict[str, Any]] = []
    for rep in range(3):
        for tracing, cpu, loop, side in (
            ("off", 1.0, 900.0, 0.0),
            ("control", 1.02, 918.0, 0.0),
            ("1", 1.1, 950.0, 50.0),
        ):
            rows.append(
                {
                    **over_row("kvpush", "push", 1, rep, 2.0, cpu_s_per_1k=cpu, tracing=tracing),
                    "loop_thread_us_per_req": loop,
                    "side_threads_us_per_req": side,
                }
            )
    lines = report_overhead.tracing_lines(rows)
    assert any(x.startswith("| 1 | off (control, A/A) | 1.02 ") and "| +2.0 % |" in x for x in lines)
    assert any(
        x.startswith("| 1 | off (control, A/A) | 918.0 ") and x.endswith("| +2.0 % (+2.0 to +2.0) |") for x in lines
    )
    assert any(x.startswith("| 1 | 100 % | 950.0 ") and x.endswith("| +11.1 % (+11.1 to +11.1) |") for x in lines)
    assert "| kvpush (A/A control) | push |" in "\n".join(report_overhead.table(report_overhead._scored(rows)))
