"""The multiturn suite's replicas plan: its fronts, its rows' suite, and the router CPU and KV-event figures read
from the routers' /metrics (issue 24)."""

from __future__ import annotations

import itertools

import httpx
import pytest

from loadtest import promtext
from loadtest.bench.suites import multiturn as suite
from loadtest.bench.suites.multiturn import replicas
from loadtest.job import REPO
from stack.engines import KV_EVENT_OFFSETS

METRICS = """\
# TYPE kvpush_kv_events_frames_total counter
kvpush_kv_events_frames_total{kind="messages"} 120.0
kvpush_kv_events_frames_total{kind="events"} 300.0
kvpush_kv_events_frames_total{kind="timed"} 120.0
kvpush_kv_events_frames_total{kind="lag_us_total"} 240000.0
kvpush_kv_events_frames_total{kind="lag_us_max"} 9000.0
kvpush_kv_events_frames_total{kind="late"} 0.0
kvpush_kv_events_sequence_total{kind="gaps"} 1.0
kvpush_kv_events_sequence_total{kind="holes"} 0.0
"""


def test_a_replicas_plan_runs_the_event_fronts_reference_first_under_its_own_suite() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2)
    assert plan.fronts == (replicas.EVENTS, replicas.REPLICAS, replicas.EVENTS_OFF)
    assert plan.suite == "multiturn-replicas"
    assert suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2, events_off_row=False).fronts[-1] == (
        replicas.REPLICAS
    )
    one = suite.MultiTurnPlan(sessions=2, session_rate=1.0)
    assert (one.fronts, one.suite) == (suite.FRONTS, "multiturn")
    assert suite.engine_family(one, REPO).specs[0].kv_events is None


def test_only_the_replicas_plan_has_its_engines_publish() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2)
    assert all(spec.kv_events == KV_EVENT_OFFSETS for spec in suite.engine_family(plan, REPO).specs)
    assert [replicas.replicas_of(f, 2) for f in plan.fronts] == [1, 2, 1]
    assert [replicas.uses_events(f) for f in plan.fronts] == [True, True, False]
    assert "port_offset: 1000" in replicas.kv_events_yaml()


def test_replicas_on_a_link_are_a_replicas_run() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2, link="ethernet-25g-like")
    assert plan.suite == "multiturn-replicas"
    assert suite.MultiTurnPlan(sessions=2, session_rate=1.0, link="ethernet-25g-like").suite == "multiturn-link"


@pytest.mark.parametrize("changes", [{"replicas": 5}, {"replicas": 0}])
def test_replicas_are_one_to_four(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="replicas"):
        suite.MultiTurnPlan(sessions=2, session_rate=1.0, **changes)  # type: ignore[arg-type]


def test_the_subscribers_counters_are_read_and_turned_into_rates_and_lag() -> None:
    counters = replicas.event_counters(promtext.parse(METRICS))
    assert counters["frames.events"] == 300 and counters["sequence.gaps"] == 1 and counters["frames.lag_us_max"] == 9000
    before = replicas.Readings(1.0, {k: 0.0 for k in counters})
    after = replicas.Readings(1.5, counters)
    got = replicas.figures(before, after, duration_s=10.0, turns=50, replicas=2)
    assert got["router_cpu_s"] == 0.5 and got["router_cpu_ms_per_turn"] == 10.0
    kv = got["kv_events"]
    assert (kv["events_per_s_per_replica"], kv["messages_per_s_per_replica"]) == (15.0, 6.0)
    assert (kv["lag_ms_mean"], kv["lag_ms_max_so_far"], kv["sequence.gaps"]) == (2.0, 9.0, 1)


def test_a_router_that_consumed_nothing_has_no_event_figures() -> None:
    none = replicas.Readings(2.0, {})
    assert replicas.figures(none, replicas.Readings(2.2, {}), 5.0, 0, 1) == {
        "router_cpu_s": 0.2,
        "router_cpu_ms_per_turn": None,
    }


def test_each_replicas_turns_and_bypasses_are_counted_first_turns_apart() -> None:
    records = [
        {"request_id": "mt-1-0000-t1", "mode": "push"},
        {"request_id": "mt-1-0001-t1", "mode": "bypass"},
        {"request_id": "mt-1-0000-t2", "mode": "bypass"},
        {"request_id": "mt-1-0000-t10", "mode": "push"},
        {"request_id": "mt-1001-0000-t2", "mode": "bypass"},  # a warmup session: another prefix
    ]
    found = replicas.count_routes(records, "mt-1-")
    assert found == {"turns": 4, "bypass": 2, "first_turns": 2, "first_bypass": 1}


def test_the_peer_row_is_vllm_routers_kv_aware_fed_every_engines_events() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2, events_off_row=False, peer_kv_aware=True)
    assert plan.fronts == (replicas.EVENTS, replicas.REPLICAS, replicas.PEER, replicas.PEER_REPLICAS)
    assert replicas.replicas_of(replicas.PEER_REPLICAS, 3) == 3 and replicas.replicas_of(replicas.PEER, 3) == 1
    decodes = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    argv = replicas.vrouter_kv_argv("vr", "http://127.0.0.1:8100", decodes, 9000, 9001, 16)
    pairs = list(itertools.pairwise(argv))
    offset = KV_EVENT_OFFSETS[0]
    assert ("--policy", "kv_aware") in pairs and ("--port", "9000") in pairs
    assert ("--pd-kv-events", f"http://127.0.0.1:8100=tcp://127.0.0.1:{8100 + offset}") in pairs
    assert "--kv-event-source" not in argv  # 0.1.17 refuses it in P/D mode
    assert ("--kv-event-block-size", "16") in pairs and ("--kv-aware-session-affinity-ttl-secs", "300") in pairs


def test_the_estimate_row_follows_the_events_without_the_tokenizer() -> None:
    plan = suite.MultiTurnPlan(sessions=2, session_rate=1.0, replicas=2, events_off_row=False, estimate_row=True)
    assert plan.fronts == (replicas.EVENTS, replicas.REPLICAS, replicas.ESTIMATE)
    assert replicas.uses_events(replicas.ESTIMATE) and replicas.replicas_of(replicas.ESTIMATE, 2) == 1


def test_after_a_reset_every_engine_is_stepped_and_the_views_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    stepped: list[str] = []
    polls = {"n": 0}

    class Answer:
        def raise_for_status(self) -> None:
            return None

    def post(url: str, json: dict[str, object], timeout: float) -> Answer:
        assert json["max_tokens"] == 1 and timeout > 0
        stepped.append(url)
        return Answer()

    def empty(bases: object, worker: str) -> bool:
        polls["n"] += 1
        return polls["n"] > 3  # the clears arrive after the steps

    monkeypatch.setattr(httpx, "post", post)
    monkeypatch.setattr(replicas, "_empty_everywhere", empty)
    assert replicas.settle_views(["http://p", "http://d"], ["http://r0"]) is not None
    assert stepped == ["http://p/v1/completions", "http://d/v1/completions"] and polls["n"] >= 4
    polls["n"] = -(10**9)
    assert replicas.settle_views(["http://p"], ["http://r0"], limit_s=0.0) is None


def test_each_replica_is_judged_turn_by_turn_against_one_routers_route() -> None:
    one = [{"mt-1-0000-t1": "push", "mt-1-0000-t2": "bypass", "mt-1-0001-t1": "push", "mt-1-0001-t2": "bypass"}]
    many = [{"mt-1-0000-t1": "push", "mt-1-0001-t2": "bypass"}, {"mt-1-0000-t2": "push", "mt-1-0001-t1": "push"}]
    assert replicas.same_route(one, many) == [
        {"turns": 2, "same": 2, "one_bypass": 1},
        {"turns": 2, "same": 1, "one_bypass": 1},
    ]
