"""The router's metrics module: the decider's and the KV-event subscriber's figures reach /metrics at scrape time."""

from __future__ import annotations

from dataclasses import replace

from router.decider import DeciderStats
from router.kv_events.view import KvEventReport
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


def test_the_kv_event_subscribers_counters_and_views_are_read_at_every_scrape() -> None:
    metrics = Metrics()
    counters = {"frames.messages": 12, "sequence.gaps": 1, "index.stored": 40, "layout.array-batch/map-events": 12}
    current = [KvEventReport({**counters, "streams": 2, "streams_caught_up": 1}, {"http://d:1": (True, 9)})]
    metrics.watch_kv_events(lambda: current[0])
    text = metrics.render()[0].decode()
    assert 'kvpush_kv_events_frames_total{kind="messages"} 12.0' in text
    assert 'kvpush_kv_events_sequence_total{kind="gaps"} 1.0' in text
    assert 'kvpush_kv_events_blocks_total{kind="stored"} 40.0' in text
    assert 'kvpush_kv_events_layouts_total{kind="array-batch/map-events"} 12.0' in text
    assert "kvpush_kv_events_streams 2.0" in text and "kvpush_kv_events_streams_caught_up 1.0" in text
    assert 'kvpush_kv_events_caught_up{worker="http://d:1"} 1.0' in text
    assert 'kvpush_kv_events_held_blocks{worker="http://d:1"} 9.0' in text
    current[0] = KvEventReport(counters, {"http://d:1": (False, 0)})
    assert 'kvpush_kv_events_caught_up{worker="http://d:1"} 0.0' in metrics.render()[0].decode()


def test_the_deciders_event_figures_are_exported() -> None:
    metrics = Metrics()
    metrics.watch_decider(
        lambda: replace(stats(1), event_decisions=5, event_corrections=2, event_matches=3, event_answer_checks=4)
    )
    text = metrics.render()[0].decode()
    assert "kvpush_decider_event_decisions_total 5.0" in text
    assert "kvpush_decider_event_corrections_total 2.0" in text and "kvpush_decider_event_matches_total 3.0" in text
    assert "kvpush_decider_event_answer_checks_total 4.0" in text
