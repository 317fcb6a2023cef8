"""What the other clients of a row under load got: the success rate over all and after the fault settled."""

from __future__ import annotations

from loadtest.faults.client import Result
from loadtest.faults.underload import judge_load

OK, FAILED = Result(200, True, None, 0.0), Result(502, False, "upstream_error", 0.0)


def test_the_success_rate_is_split_at_the_settling_time() -> None:
    results = [(1.0, OK), (10.5, FAILED), (11.0, OK), (19.0, OK), (25.0, OK)]
    every, later, note = judge_load(results, t_fault=10.0, settle_s=8.0)
    assert (every, later) == (0.8, 1.0)
    assert "served 80.0% of 5, 100.0% of the 2 started 8 s after the fault" in note


def test_no_other_clients_is_not_a_failure() -> None:
    assert judge_load([], t_fault=0.0, settle_s=1.0)[:2] == (1.0, 1.0)
