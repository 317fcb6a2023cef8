"""The worker health state machine: every state × event, backoff growth and reset."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.workers.health import Health, HealthPolicy, WorkerHealth, stalled

POLICY = HealthPolicy(eject_after=3, base_backoff=1.0, max_backoff=4.0)


def at(state: Health) -> WorkerHealth:
    h = WorkerHealth(POLICY)
    if state is Health.UP:
        h.on_probe_ok(0.0)
    elif state is Health.DOWN:
        h.on_probe_failed(0.0)
    assert h.state is state
    return h


@pytest.mark.parametrize(
    ("start", "event", "end", "changed"),
    [
        (Health.UNKNOWN, "probe_ok", Health.UP, True),
        (Health.UNKNOWN, "probe_failed", Health.DOWN, False),
        (Health.UNKNOWN, "probe_timed_out", Health.DOWN, False),
        (Health.UNKNOWN, "hard_failure", Health.DOWN, True),
        (Health.UNKNOWN, "soft_failure", Health.UNKNOWN, False),
        (Health.UNKNOWN, "request_ok", Health.UNKNOWN, None),
        (Health.UP, "probe_ok", Health.UP, False),
        (Health.UP, "probe_failed", Health.DOWN, True),
        (Health.UP, "probe_timed_out", Health.UP, False),
        (Health.UP, "hard_failure", Health.DOWN, True),
        (Health.UP, "soft_failure", Health.UP, False),
        (Health.UP, "request_ok", Health.UP, None),
        (Health.DOWN, "probe_ok", Health.UP, True),
        (Health.DOWN, "probe_failed", Health.DOWN, False),
        (Health.DOWN, "probe_timed_out", Health.DOWN, False),
        (Health.DOWN, "hard_failure", Health.DOWN, False),
        (Health.DOWN, "soft_failure", Health.DOWN, False),
        (Health.DOWN, "request_ok", Health.DOWN, None),
    ],
)
def test_every_state_and_event(start: Health, event: str, end: Health, changed: bool | None) -> None:
    h = at(start)
    events: dict[str, Callable[[], bool | None]] = {
        "probe_ok": lambda: h.on_probe_ok(1.0),
        "probe_failed": lambda: h.on_probe_failed(1.0),
        "probe_timed_out": lambda: h.on_probe_failed(1.0, timed_out=True),
        "hard_failure": lambda: h.on_request_failed(1.0, hard=True),
        "soft_failure": lambda: h.on_request_failed(1.0, hard=False),
        "request_ok": lambda: h.on_request_ok(1.0),
    }
    result = events[event]()
    assert h.state is end
    assert result is changed
    assert h.usable is (end is Health.UP)


def test_soft_failures_eject_after_n_in_a_row_and_success_resets_the_streak() -> None:
    h = at(Health.UP)
    assert not h.on_request_failed(1.0, hard=False)
    assert not h.on_request_failed(1.0, hard=False)
    h.on_request_ok(1.0)
    assert not h.on_request_failed(1.0, hard=False)
    assert not h.on_request_failed(1.0, hard=False)
    assert h.on_request_failed(1.0, hard=False)
    assert h.state is Health.DOWN


def test_an_ejected_worker_is_held_out_for_a_doubling_backoff() -> None:
    h = at(Health.UP)
    holds = []
    now = 10.0
    for _ in range(4):
        assert h.on_request_failed(now, hard=True)
        assert not h.on_probe_ok(h.held_until - 0.01), "a probe inside the hold does not bring it back"
        assert h.on_probe_ok(h.held_until)
        holds.append(h.held_until - now)
        now = h.held_until
    assert holds == [1.0, 2.0, 4.0, 4.0]
    h.on_request_ok(now)
    assert h.on_request_failed(now, hard=True) and h.held_until - now == 1.0


def test_an_up_worker_goes_down_at_the_second_probe_timeout_in_a_row() -> None:
    h = at(Health.UP)
    assert not h.on_probe_failed(1.0, timed_out=True) and h.confirming and h.usable
    assert h.on_probe_failed(1.1, timed_out=True) and h.state is Health.DOWN and not h.confirming


def test_an_answer_between_two_probe_timeouts_resets_the_count() -> None:
    h = at(Health.UP)
    for now in (1.0, 2.0, 3.0):
        assert not h.on_probe_failed(now, timed_out=True)
        assert not h.on_probe_ok(now + 0.1) and not h.confirming
    assert h.state is Health.UP


def test_a_refusal_after_a_probe_timeout_takes_the_worker_down_at_once() -> None:
    h = at(Health.UP)
    assert not h.on_probe_failed(1.0, timed_out=True)
    assert h.on_probe_failed(1.1)
    assert h.state is Health.DOWN


def test_one_probe_timeout_takes_a_worker_down_when_the_policy_says_so() -> None:
    h = WorkerHealth(HealthPolicy(probe_timeouts=1))
    h.on_probe_ok(0.0)
    assert h.on_probe_failed(1.0, timed_out=True) and h.state is Health.DOWN


def test_probe_timeouts_do_not_count_while_the_worker_answers_legs() -> None:
    """A starved box: /health answers late while legs are answered (the Dec 7 soak lost its only decode so)."""
    h = at(Health.UP)
    for now in (1.0, 2.0, 3.0, 4.0):
        h.on_request_ok(now - 0.5)
        assert not h.on_probe_failed(now, timed_out=True) and not h.confirming
        assert not h.on_probe_failed(now + 0.1, timed_out=True)
    assert h.state is Health.UP


def test_a_hung_worker_goes_down_once_its_last_answer_is_older_than_the_window() -> None:
    h = at(Health.UP)
    h.on_request_ok(1.0)  # then it hangs: nothing more is answered
    assert not h.on_probe_failed(2.5, timed_out=True) and not h.confirming  # answered 1.5 s ago: alive
    assert not h.on_probe_failed(3.5, timed_out=True) and h.confirming  # 2.5 s of silence: this one counts
    assert h.on_probe_failed(3.6, timed_out=True) and h.state is Health.DOWN


def test_a_refused_probe_takes_a_worker_down_even_while_it_answers_legs() -> None:
    h = at(Health.UP)
    h.on_request_ok(1.0)
    assert h.on_probe_failed(1.1) and h.state is Health.DOWN


# ------------------------------------------------------------------------------------------------ the stall rule

STALL = HealthPolicy(stall_base=5.0, stall_per_token=0.01)


def test_a_leg_that_waits_past_its_budget_with_no_answer_meanwhile_means_stalled() -> None:
    assert STALL.stall_budget(100) == 6.0
    assert not stalled([(10.0, 100)], last_answer=0.0, now=16.0, policy=STALL)
    assert stalled([(10.0, 100)], last_answer=0.0, now=16.1, policy=STALL)


def test_an_answer_after_the_leg_began_restarts_its_wait() -> None:
    """The engine answered another leg meanwhile: it makes progress, so the long leg waits from that answer."""
    assert not stalled([(10.0, 100)], last_answer=15.0, now=20.0, policy=STALL)
    assert stalled([(10.0, 100)], last_answer=15.0, now=21.5, policy=STALL)


def test_long_prompts_get_a_longer_budget_and_no_legs_is_never_stalled() -> None:
    assert not stalled([(0.0, 10_000)], last_answer=0.0, now=100.0, policy=STALL)
    assert stalled([(0.0, 10_000), (90.0, 1)], last_answer=0.0, now=100.0, policy=STALL)
    assert not stalled([], last_answer=0.0, now=1e9, policy=STALL)
