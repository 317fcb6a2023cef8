"""The link suite's plans and engine families (pure: no engine starts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from connector.options import Options
from loadtest.bench.run import with_overrides
from loadtest.bench.suites import link, multiturn
from loadtest.results import RowLabels


def test_the_full_plan_puts_the_targets_preset_first_and_repeats_it_three_times() -> None:
    steps = link.FULL.steps()
    assert steps[0].preset == "ethernet-100g-like" and steps[0].input_len == 1024 and steps[0].headline
    assert steps[0].qps == (1.0, 3.0) and steps[0].repeats >= 3
    assert {(s.input_len, s.preset) for s in steps} == {
        (n, p) for n in (1024, 4096) for p in ("ethernet-100g-like", "efa-like", "ethernet-25g-like")
    }
    assert link.FULL.max_model_len >= 4096 + 64
    assert len(link.SMOKE.steps()) == 1


def test_ours_runs_the_product_default_and_its_second_prefill_prefills_in_chunks() -> None:
    pull, upush, ours = link.families(link.FULL, Path("/m"))
    assert [s.connector for s in (*pull.specs, *upush.specs)] == ["NixlConnector"] * 2 + ["NixlPushConnector"] * 2
    assert all("progress" not in s.connector_extra for s in ours.specs), "the product default: no override"
    assert link.FULL.progress_model == "thread", "auto, on the namespaces' addresses"
    assert not pull.specs[0].connector_extra
    p0, p1, *_ = ours.prefills
    assert p0.extra_args[-2:] == ("--max-num-batched-tokens", str(link.FULL.max_model_len))
    assert p1.extra_args[-2:] == ("--max-num-batched-tokens", "256")
    assert len(ours.decodes) == 1


@pytest.mark.parametrize("model", ["poll", "thread", "auto"])
def test_a_candidate_progress_model_runs_on_every_engine_of_ours_and_nowhere_else(model: str) -> None:
    plan = with_overrides(link.FULL, [f"progress={model}"])
    pull, upush, ours = link.families(plan, Path("/m"))
    assert [s.connector_extra["progress"] for s in ours.specs] == [model] * 4
    assert not any(s.connector_extra for s in (*pull.specs, *upush.specs))
    assert plan.progress_model == ("thread" if model == "auto" else model)


def test_an_unknown_progress_model_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'spin' is not one of \\['auto', 'poll', 'thread'\\]"):
        with_overrides(link.FULL, ["progress=spin"])


def test_the_step_wise_candidate_writes_once_per_step_beside_the_layer_wise_default() -> None:
    *_, ours = link.families(link.FULL, Path("/m"))
    _, _, p2 = ours.prefills
    assert [p.connector_extra.get("push_granularity") for p in ours.specs] == [
        None,
        None,
        "step",
        None,
    ], "the decode and the default prefills run the product default"
    assert Options.push_granularity == "layer"
    assert p2.extra_args[-2:] == ("--max-num-batched-tokens", str(link.FULL.max_model_len))
    *_, without = link.families(dataclasses.replace(link.FULL, step=False), Path("/m"))
    assert len(without.prefills) == 2


def test_the_deleted_layer_chunked_front_can_be_neither_planned_nor_recorded() -> None:
    with pytest.raises(ValueError):
        with_overrides(link.FULL, ["layer_chunk_tokens=512"])
    with pytest.raises(ValueError, match="kvpush-layer-chunked"):
        RowLabels("link", "kvpush", "push", "kvpush-layer-chunked", 1.0, None, 1024, 64)


def test_multiturn_on_a_link_names_its_rows_apart_and_refuses_an_unknown_preset() -> None:
    plan = multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="ethernet-25g-like")
    assert plan.suite == "multiturn-link" and multiturn.FULL.suite == "multiturn"
    fam = multiturn.engine_family(
        multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="efa-like", connector="kvpush-push"), Path("/m")
    )
    # the product's defaults on the link too: `progress: auto` is the thread on a namespace's (non-loopback) address
    assert all(not s.connector_extra for s in fam.specs)
    try:
        multiturn.MultiTurnPlan(sessions=2, session_rate=1.0, link="nope")
    except ValueError as exc:
        assert "known" in str(exc)
    else:
        raise AssertionError("an unknown preset was accepted")
