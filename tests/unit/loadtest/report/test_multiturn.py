"""The multiturn section folds a front's repeats (median and range) and judges each target on the ratio within each
repeat, where the fronts saw the same sessions."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.bench.suites import multiturn as suite
from loadtest.report import multiturn as report


def row(front: str, repeat: int, later: float, first: float = 100.0, **extra: Any) -> dict[str, Any]:
    return {
        "front": front,
        "repeat": repeat,
        "turns_ok": 10,
        "turns_failed": 0,
        "ttft_ms_turn1": {"p50": first},
        "ttft_ms_turn2plus": {"p50": later},
        "tpot_ms_all": {"p50": 9.0},
        **extra,
    }


RUN = [
    row("kvpush", 0, 200.0, decode_prompt_tokens_by_source={"local_cache_hit": 100.0}),
    row("kvpush-decider", 0, 100.0, bypass_accuracy={"checked": 10, "accurate": 9}, routes={"bypass": 4, "push": 6}),
    row("vllm-router", 0, 250.0),
    row("vllm-router", 1, 150.0),  # odd repeat: the fronts ran in reverse order
    row("kvpush-decider", 1, 120.0, bypass_accuracy={"checked": 10, "accurate": 7}, routes={"bypass": 5, "push": 5}),
    row("kvpush", 1, 240.0, decode_prompt_tokens_by_source={"local_cache_hit": 50.0}),
]


def test_ratios_are_paired_within_each_repeat() -> None:
    assert report.paired_ratios(RUN, "kvpush-decider", "vllm-router") == [0.4, 0.8]
    assert report.paired_ratios(RUN, "kvpush-decider", "kvpush") == [0.5, 0.5]
    assert report.paired_ratios(RUN[:2], "kvpush-decider", "vllm-router") == []  # theirs never ran


def test_a_front_is_one_line_with_median_and_range_over_its_repeats() -> None:
    lines = report.section(RUN, None)
    assert lines[0].startswith("| front | repeats |")
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| kvpush", "| kvpush-decider", "| vllm-router"]
    decider = lines[3].split(" | ")
    assert decider[1:5] == ["2", "20/0", "100 (100-100)", "110 (100-120)"]
    assert "bypass 9, push 11" in lines[3] and lines[3].endswith("| 16/20 (80%) |")  # counts summed over repeats
    assert "| 150 / 0 / 0 |" in lines[2]  # decode's tokens by source, summed
    assert lines[1].count("|") == lines[0].count("|") == lines[3].count("|")


def test_targets_are_judged_on_the_median_of_the_paired_ratios() -> None:
    text = "\n".join(report.section(RUN, None))
    assert "decider / vllm-router: 0.60 (per repeat: 0.40, 0.80; target <= 0.5: not met)" in text
    assert "decider / kvpush: 0.50 (per repeat: 0.50, 0.50; target <= 0.6: met)" in text
    assert "decider: 16/20 (80%) (target >= 90% of bypass decisions: not met)" in text


def test_one_repeat_shows_plain_cells() -> None:
    lines = report.section([row("kvpush", 0, 200.0)], None)
    assert lines[2].split(" | ")[1:5] == ["1", "10/0", "100", "200"]


def test_counter_growth_is_taken_between_two_scrapes() -> None:
    assert suite.grown({"checked": 4, "accurate": 3}, {"checked": 10, "accurate": 8}) == {"checked": 6, "accurate": 5}
    assert suite.grown(None, {"checked": 2, "accurate": 2}) == {"checked": 2, "accurate": 2}
    assert suite.grown({"checked": 2, "accurate": 2}, None) is None


def test_each_repeat_takes_new_sessions_and_at_least_one_repeat_is_needed() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, seed=5)
    assert (plan.shape().seed, plan.shape(1).seed) == (5, 6)
    assert suite.FULL.repeats >= 2 and suite.SMOKE.repeats == 1
    with pytest.raises(ValueError, match="at least 1"):
        suite.MultiTurnPlan(sessions=2, session_rate=1.0, repeats=0)


def test_the_section_names_the_connector_and_sessions() -> None:
    plan = {"sessions": 24, "connector": "kvpush-push"}
    text = "\n".join(report.section([{**r, "plan": plan} for r in RUN], None))
    assert "24 sessions per repeat through each front; connector `kvpush-push`" in text
