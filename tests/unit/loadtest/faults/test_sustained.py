"""How the sustained-load rows judge what their clients got (no sockets): a preempted prefill's answers must equal
the single instance's or fail clearly, and a preemption must have happened; a killed replica's clients see a cut,
the survivor's are all served."""

from __future__ import annotations

from loadtest.faults import client
from loadtest.faults.sustained import Answer, judge_preemption, judge_replica

MOVED = {"preemptions": 2.0, "partial WRITEs": 9.0, "fences": 2.0, "fence timeouts": 0.0, "failed transfers": 0.0}


def answer(status: int | None, text: str | None = None, error: str | None = None) -> Answer:
    return Answer({}, status, text, error, 0.0, 1.0)


def test_answers_equal_to_the_single_instance_or_failed_clearly_are_clean() -> None:
    answers = [answer(200, "a"), answer(200, "b"), answer(502, error="upstream_error")]
    outcome = judge_preemption(answers, {0: "a", 1: "b"}, MOVED)
    assert outcome.acceptable and outcome.summary == "200 equal x2, 5xx with error x1"
    assert "preemptions +2" in outcome.note


def test_an_answer_unlike_the_single_instance_is_not_clean() -> None:
    outcome = judge_preemption([answer(200, "a"), answer(200, "mixed")], {0: "a", 1: "b"}, MOVED)
    assert not outcome.acceptable and "200 differ x1" in outcome.summary


def test_a_failure_without_an_error_body_is_not_clean() -> None:
    outcome = judge_preemption([answer(200, "a"), answer(502)], {0: "a"}, MOVED)
    assert not outcome.acceptable and "unclear x1" in outcome.summary


def test_a_run_that_preempted_nothing_tested_nothing() -> None:
    outcome = judge_preemption([answer(200, "a")], {0: "a"}, {**MOVED, "preemptions": 0.0})
    assert not outcome.acceptable


def result(status: int | None, complete: bool, t_end: float = 5.0) -> client.Result:
    return client.Result(status, complete, None, t_end)


def test_the_victims_clients_see_a_cut_and_the_survivors_are_served() -> None:
    outcome = judge_replica([result(200, False, 4.5), result(200, False, 4.2)], [result(200, True)] * 5, 4.0)
    assert outcome.acceptable and outcome.fault_to_outcome_s == 0.5
    assert "served 5 of 5" in outcome.note


def test_a_survivor_client_that_failed_makes_the_row_unclean() -> None:
    outcome = judge_replica([result(200, False)], [result(200, True), result(502, False)], 4.0)
    assert not outcome.acceptable


def test_a_victim_client_that_was_served_in_full_means_the_kill_came_too_late() -> None:
    outcome = judge_replica([result(200, True)], [result(200, True)], 4.0)
    assert not outcome.acceptable


def test_a_victim_client_without_an_answer_means_the_kill_came_before_the_streams() -> None:
    outcome = judge_replica([result(None, False)], [result(200, True)], 4.0)
    assert not outcome.acceptable
