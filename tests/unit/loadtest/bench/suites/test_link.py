"""The link suite's plans and engine families (pure: no engine starts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from loadtest.bench.suites import link, multiturn


def test_the_full_plan_puts_the_targets_preset_first_and_repeats_it_three_times() -> None:
    steps = link.FULL.steps()
    assert steps[0].preset == "ethernet-100g-like" and steps[0].input_len == 1024 and steps[0].headline
    assert steps[0].qps == (1.0, 3.0) and steps[0].repeats >= 3
    assert {(s.input_len, s.preset) for s in steps} == {
        (n, p) for n in (1024, 4096) for p in ("ethernet-100g-like", "efa-like", "ethernet-25g-like")
    }
    assert link.FULL.max_model_len >= 4096 + 64
    assert len(link.SMOKE.steps()) == 1


def test_ours_runs_the_progress_thread_and_its_second_prefill_prefills_in_chunks() -> None:
    pull, upush, ours = link.families(link.FULL, Path("/m"))
    assert [s.connector for s in (*pull.specs, *upush.specs)] == ["NixlConnector"] * 2 + ["NixlPushConnector"] * 2
    assert all(s.connector_extra["progress"] == "thread" for s in ours.specs)
    assert not pull.specs[0].connector_extra
    p0, p1, *_ = ours.prefills
    assert p0.extra_args[-2:] == ("--max-num-batched-tokens", str(link.FULL.max_model_len))
    assert p1.extra_args[-2:] == ("--max-num-batched-tokens", "256")
    assert len(ours.decodes) == 1


def test_the_layer_wise_prefills_push_by_layer_one_in_one_step_one_in_chunks() -> None:
    *_, ours = link.families(link.FULL, Path("/m"))
    _, _, p2, p3 = ours.prefills
    assert [p.connector_extra.get("push_granularity", "step") for p in ours.specs] == ["step"] * 2 + ["layer"] * 2 + [
        "step"
    ], "the decode and the step-wise prefills keep the default"
    assert p2.extra_args[-2:] == ("--max-num-batched-tokens", str(link.FULL.max_model_len))
    assert p3.extra_args[-2:] == ("--max-num-batched-tokens", "512")
    *_, without = link.families(dataclasses.replace(link.FULL, layer=False), Path("/m"))
    assert len(without.prefills) == 2


def test_multiturn_on_a_link_names_its_rows_apart_and_refuses_an_unknown_preset() -> None:
    plan = multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="ethernet-25g-like")
    assert plan.suite == "multiturn-link" and multiturn.FULL.suite == "multiturn"
    fam = multiturn.engine_family(
        multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="efa-like", connector="kvpush-push"), Path("/m")
    )
    assert all(s.connector_extra == {"progress": "thread"} for s in fam.specs)
    try:
        multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="nope")
    except ValueError as exc:
        assert "known" in str(exc)
    else:
        raise AssertionError("an unknown preset was accepted")
