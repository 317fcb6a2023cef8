"""The multiturn suite's plan (plan.py): warmup sessions, the decider's bypass threshold on a link, issue 40's
plan fields."""

from __future__ import annotations

from dataclasses import replace

from loadtest import multiturn
from loadtest.bench.suites.multiturn import plan as suite
from stack.link import bypass
from stack.link.plan import preset, resolve


def test_warmup_sessions_are_short_and_never_share_an_id_with_a_measured_one() -> None:
    plan = suite.FULL
    warm = suite.warmup(plan)
    assert len(warm) == plan.warmup_sessions > 0 and all(len(s.turns) == 2 for s in warm)
    measured = {s.id for r in range(plan.repeats) for s in multiturn.plan_sessions(plan.shape(r))}
    assert not measured & {s.id for s in warm}
    assert suite.SMOKE.warmup_sessions == 0  # make test's smoke stays as cheap as it was


def test_on_a_link_the_decider_gets_the_bypass_threshold_the_link_derives_unless_set_by_hand() -> None:
    plan = suite.MultiTurnPlan(sessions=4, session_rate=0.5, link="ethernet-25g-like")
    kv = plan.link_calibrate_tokens * 65536
    link = resolve(preset("ethernet-25g-like"), prefill_s=0.5, kv_bytes=kv)
    derived = dict(suite.on_link(plan, link).decider_options)[bypass.OPTION]
    assert derived == bypass.for_link(link, plan.link_calibrate_tokens) > bypass.BASE_TOKENS
    assert f"bypass_max_uncached_tokens: {derived:g}" in suite.decider_yaml(suite.on_link(plan, link))
    by_hand = replace(plan, decider_options=((bypass.OPTION, 512.0),))
    assert suite.on_link(by_hand, link).decider_options == ((bypass.OPTION, 512.0),)


def test_issue_40s_plan_fields_reach_the_sessions() -> None:
    plan = suite.MultiTurnPlan(sessions=4, session_rate=1.0, api="both", burst=2, replicas=2)
    sessions = multiturn.plan_sessions(plan.shape())
    assert [s.api for s in sessions] == ["chat", "completions"] * 2
    assert sessions[0].start_s == sessions[1].start_s != sessions[2].start_s == sessions[3].start_s
