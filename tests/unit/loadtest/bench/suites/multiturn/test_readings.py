"""The multiturn suite's bypass-prediction accuracy (readings.py): read from the router's /metrics text, shown in
the front's row and stated against issue 11's target (>= 90 % of bypass decisions within 20 %) in the section."""

from __future__ import annotations

from typing import Any

from loadtest import promtext
from loadtest.bench.suites.multiturn import readings as suite
from loadtest.report import multiturn as report

# what prometheus_client renders for the decider collector's counters (a counter gets the `_total` suffix)
METRICS = """\
# HELP kvpush_bypass_checked_total Bypass decisions whose usage reported cached tokens.
# TYPE kvpush_bypass_checked_total counter
kvpush_bypass_checked_total 20.0
# HELP kvpush_bypass_accurate_total Checked bypasses predicted within 20 % of the actual uncached tokens.
# TYPE kvpush_bypass_accurate_total counter
kvpush_bypass_accurate_total 19.0
kvpush_bypass_predicted_cached_tokens_total 4000.0
kvpush_decider_sessions 3.0
"""


def test_the_counters_are_read_with_or_without_the_total_suffix() -> None:
    assert suite.bypass_accuracy(promtext.parse(METRICS)) == {"checked": 20, "accurate": 19, "predicted_cached": 4000}
    bare = "kvpush_bypass_checked 4\nkvpush_bypass_accurate 1\n"
    assert suite.bypass_accuracy(promtext.parse(bare)) == {"checked": 4, "accurate": 1}


def test_a_router_without_a_decider_has_no_accuracy() -> None:
    assert suite.bypass_accuracy(promtext.parse("kvpush_in_flight 0\n")) is None
    assert suite.bypass_accuracy(promtext.parse("kvpush_bypass_checked_total 3\n")) is None  # half is none
    assert report.accuracy_text(None) == "-"


def test_the_row_shows_accurate_over_checked_and_the_share() -> None:
    assert report.accuracy_text({"checked": 20, "accurate": 19}) == "19/20 (95%)"
    assert report.accuracy_text({"checked": 0, "accurate": 0}) == "0/0"


def test_the_target_is_met_at_ninety_percent_and_not_below() -> None:
    assert report.accuracy_line({"checked": 10, "accurate": 9}).endswith(
        "decider: 9/10 (90%) (target >= 90% of bypass decisions: met)"
    )
    assert report.accuracy_line({"checked": 10, "accurate": 8}).endswith(": not met)")
    none_checked = report.accuracy_line({"checked": 0, "accurate": 0})
    assert none_checked.endswith("no bypass checked (target >= 90% of bypass decisions: not measured)")
    assert report.accuracy_line(None).endswith(": not measured)")


def row(front: str, accuracy: dict[str, int] | None) -> dict[str, Any]:
    return {"front": front, "turns_ok": 4, "turns_failed": 0, "bypass_accuracy": accuracy}


def test_the_section_has_a_column_per_front_and_the_deciders_verdict() -> None:
    lines = report.section([row("kvpush", None), row("kvpush-decider", {"checked": 8, "accurate": 6})], None)
    assert lines[0].endswith("| bypass predictions within ±20 % |")
    assert lines[2].startswith("| kvpush |") and lines[2].endswith("| - |")
    assert lines[3].startswith("| kvpush-decider |") and lines[3].endswith("| 6/8 (75%) |")
    assert lines[1].count("|") == lines[0].count("|") == lines[3].count("|")
    assert "\nbypass predictions within ±20 %, decider: 6/8 (75%) (target >= 90% of bypass decisions: not met)" in lines


def test_without_a_decider_front_the_section_states_no_accuracy() -> None:
    assert not any("bypass predictions within" in line for line in report.section([row("kvpush", None)], None)[1:])


def test_the_predicted_and_reported_cached_tokens_are_read_with_the_counts() -> None:
    text = METRICS + "kvpush_bypass_actual_cached_tokens_total 3968.0\n"
    found = suite.bypass_accuracy(promtext.parse(text))
    assert found == {"checked": 20, "accurate": 19, "predicted_cached": 4000, "actual_cached": 3968}
