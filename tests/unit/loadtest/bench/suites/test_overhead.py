"""The overhead suite's plan of kvpush fronts and the environment each router starts with (pure)."""

import os
from dataclasses import replace

import pytest

from loadtest.bench.run import with_overrides
from loadtest.bench.suites import overhead as suite_overhead
from loadtest.bench.suites.overhead import FULL, KvpushVariant, kvpush_fronts


def test_by_default_one_push_and_one_pull_front() -> None:
    assert kvpush_fronts(FULL) == [KvpushVariant("push"), KvpushVariant("pull")]
    assert [f.name for f in kvpush_fronts(FULL)] == ["router-push", "router-pull"]
    assert [f.default for f in kvpush_fronts(FULL)] == [True, True]


@pytest.mark.parametrize("gone", ["servers=uvicorn,granian", "leg_clients=http1,aiohttp"])
def test_the_deleted_server_and_leg_client_dimensions_cannot_be_run(gone: str) -> None:
    with pytest.raises(ValueError):
        with_overrides(FULL, [gone])


def test_no_tracing_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="overhead: tracings must name"):
        kvpush_fronts(replace(FULL, tracings=()))


def test_each_router_starts_without_a_leg_client_or_server_and_the_environment_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPUSH_TRACING", "true")
    with suite_overhead._router_env(KvpushVariant("push")):
        assert os.environ["KVPUSH_TRACING"] == "false"
        assert "KVPUSH_LEG_CLIENT" not in os.environ and "KVPUSH_SERVER" not in os.environ
    assert os.environ["KVPUSH_TRACING"] == "true"


def test_the_suite_s_routers_give_a_starved_simulator_a_long_health_deadline() -> None:
    assert suite_overhead.ROUTER_FLAGS == ("--timeout", "health=10")


def test_a_traced_front_per_ratio_with_its_tracing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPUSH_TRACING", raising=False)
    plan = suite_overhead.OverheadPlan(8, 2, ((1, 2),), tracings=("off", "1", "0.01"))
    fronts = suite_overhead.kvpush_fronts(plan)
    assert [(f.mode, f.tracing) for f in fronts] == [("push", "off"), ("push", "1"), ("push", "0.01"), ("pull", "off")]
    assert [f.name for f in fronts][:3] == ["router-push", "router-push-trace1", "router-push-trace0.01"]
    with suite_overhead._router_env(fronts[2], "http://127.0.0.1:4317"):
        assert os.environ["KVPUSH_TRACING"] == "true" and os.environ["OTEL_TRACES_SAMPLER_ARG"] == "0.01"
        assert os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4317"
    with suite_overhead._router_env(fronts[0], "http://127.0.0.1:4317"):
        assert os.environ["KVPUSH_TRACING"] == "false"
    assert "KVPUSH_TRACING" not in os.environ
    with pytest.raises(ValueError, match="tracings"):
        suite_overhead.kvpush_fronts(suite_overhead.OverheadPlan(8, 2, ((1, 2),), tracings=("2",)))


def test_kv_events_from_set_add_a_push_front_that_follows_events_under_its_own_suite() -> None:
    plan = with_overrides(FULL, ["kv_events=off,on"])
    fronts = kvpush_fronts(plan)
    assert [(f.mode, f.kv_events, f.name, f.default) for f in fronts] == [
        ("push", "off", "router-push", True),
        ("push", "on", "router-push-events", False),
        ("pull", "off", "router-pull", True),
    ]
    assert (plan.suite, FULL.suite) == ("overhead-events", "overhead")


@pytest.mark.parametrize("changes", [["kv_events=maybe"], ["kv_events=on", "cprofile=true"]])
def test_unknown_kv_event_settings_and_profiling_an_events_run_are_refused(changes: list[str]) -> None:
    with pytest.raises(ValueError, match="kv_events"):
        kvpush_fronts(with_overrides(FULL, changes))


def test_the_control_is_a_second_untraced_push_router_and_needs_off() -> None:
    plan = suite_overhead.OverheadPlan(8, 2, ((1, 2),), tracings=("off", "control", "1"))
    fronts = suite_overhead.kvpush_fronts(plan)
    assert [(f.tracing, f.traced, f.name) for f in fronts] == [
        ("off", False, "router-push"),
        ("control", False, "router-push-control"),
        ("1", True, "router-push-trace1"),
        ("off", False, "router-pull"),
    ]
    with suite_overhead._router_env(fronts[1], "http://127.0.0.1:4317"):
        assert os.environ["KVPUSH_TRACING"] == "false"
    with pytest.raises(ValueError, match="name off too"):
        suite_overhead.kvpush_fronts(suite_overhead.OverheadPlan(8, 2, ((1, 2),), tracings=("control", "1")))
    with pytest.raises(ValueError, match="separate runs"):
        suite_overhead.kvpush_fronts(with_overrides(plan, ["kv_events=off,on"]))
    with pytest.raises(ValueError, match="cprofile and traced fronts"):
        suite_overhead.kvpush_fronts(with_overrides(plan, ["cprofile=true"]))


def test_traced_routers_keep_the_sdks_batch_delay_and_a_point_waits_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite no longer shortens the batch delay (a user's router exports every 5 s or per 512 spans); a traced
    point reads its export threads after the delay and a second, so its last batch is counted in it."""
    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    with suite_overhead._router_env(KvpushVariant("push", "1"), "http://127.0.0.1:4317"):
        assert "OTEL_BSP_SCHEDULE_DELAY" not in os.environ
        assert suite_overhead.export_wait_s() == 6.0
    assert suite_overhead.export_wait_s({"OTEL_BSP_SCHEDULE_DELAY": "500"}) == 1.5
    assert suite_overhead.export_wait_s({"OTEL_BSP_SCHEDULE_DELAY": "soon"}) == 6.0
