"""How the link row judges its clients (no sockets): the single instance's answer or a clear error, nothing else."""

from __future__ import annotations

from loadtest.faults.link import judge_link
from loadtest.faults.sustained import Answer


def answer(status: int | None, text: str | None = None, error: str | None = None, t_end: float = 3.0) -> Answer:
    return Answer({}, status, text, error, 0.0, t_end)


def test_equal_answers_and_clear_errors_are_clean_and_timed_from_the_cut() -> None:
    answers = [answer(200, "a", t_end=12.0), answer(504, error="timeout", t_end=9.0)]
    outcome = judge_link(answers, {0: "a"}, 2.0, "note")
    assert outcome.acceptable and outcome.summary == "200 equal x1, 504 (timeout) x1"
    assert outcome.fault_to_outcome_s == 10.0


def test_an_answer_unlike_the_single_instance_or_an_unclear_failure_is_not_clean() -> None:
    assert not judge_link([answer(200, "mixed")], {0: "a"}, 0.0, "").acceptable
    assert not judge_link([answer(None, error="ReadTimeout")], {}, 0.0, "").acceptable
    assert not judge_link([answer(500)], {}, 0.0, "").acceptable
