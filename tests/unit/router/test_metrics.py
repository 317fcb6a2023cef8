"""The router's metrics module: the decider's figures reach /metrics at scrape time."""

from __future__ import annotations

from router.decider import DeciderStats
from router.metrics import Metrics


def stats(sessions: int) -> DeciderStats:
    return DeciderStats(
        decisions={"bypass": 2, "push": 1},
        index_links={"decode": 5, "prefill": 3},
        sessions=sessions,
        evictions={"decode/capacity": 1, "sessions/expired": 2},
        predicted_cached_tokens=100,
        actual_cached_tokens=96,
        checked_bypasses=2,
        accurate_bypasses=2,
        tokens_per_char=0.25,
        answers_trusted=False,
        answers_checked=9,
        answers_short=3,
    )


def test_a_deciders_index_figures_are_read_at_every_scrape() -> None:
    metrics, current = Metrics(), [stats(4)]
    metrics.watch_decider(lambda: current[0])
    text = metrics.render()[0].decode()
    assert 'kvpush_decider_index_links{role="decode"} 5.0' in text
    assert "kvpush_decider_sessions 4.0" in text
    assert 'kvpush_decider_evictions_total{cause="expired",table="sessions"} 2.0' in text
    assert "kvpush_bypass_accurate_total 2.0" in text and "kvpush_decider_answers_trusted 0.0" in text
    assert "kvpush_decider_answers_checked_total 9.0" in text and "kvpush_decider_answers_short_total 3.0" in text
    current[0] = stats(7)
    assert "kvpush_decider_sessions 7.0" in metrics.render()[0].decode()


def test_the_none_decider_exports_nothing() -> None:
    metrics = Metrics()
    metrics.watch_decider(lambda: None)
    assert "kvpush_decider" not in metrics.render()[0].decode()
