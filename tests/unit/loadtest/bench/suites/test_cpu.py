"""The cpu-vllm plan's `pairs`: all three by default, one or several through `--set`, unknown labels refused."""

from pathlib import Path

import pytest

from loadtest.bench import run as bench
from loadtest.bench.suites import cpu as suite_cpu


def test_every_pair_boots_by_default_in_the_suites_order() -> None:
    for plan in (suite_cpu.FULL, suite_cpu.SMOKE):
        assert plan.pairs == ("upstream-pull", "upstream-push", "kvpush-push")
        assert plan.families == suite_cpu.FAMILIES


def test_set_pairs_picks_pairs_and_keeps_the_suites_order() -> None:
    one = bench.with_overrides(suite_cpu.SMOKE, ["pairs=kvpush-push"])
    assert one.pairs == ("kvpush-push",)
    assert [f.connector for f in one.families] == ["KvpushConnector"]
    two = bench.with_overrides(suite_cpu.SMOKE, ["pairs=kvpush-push, upstream-pull"])
    assert [f.label for f in two.families] == ["upstream-pull", "kvpush-push"]


@pytest.mark.parametrize(("value", "says"), [("kvpush-pull", "unknown kvpush-pull"), ("", "none given")])
def test_unknown_or_no_pairs_are_refused_naming_the_known_ones(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as error:
        bench.with_overrides(suite_cpu.SMOKE, [f"pairs={value}"])
    assert "known: upstream-pull, upstream-push, kvpush-push" in str(error.value)


def test_the_default_candidates_boot_only_when_named_each_on_its_own_pair() -> None:
    plan = bench.with_overrides(suite_cpu.FULL, ["pairs=upstream-pull,kvpush-push,kvpush-step,kvpush-thread"])
    assert [f.label for f in plan.families] == ["upstream-pull", "kvpush-push", "kvpush-step", "kvpush-thread"]
    extras = {f.label: suite_cpu.pair_family(f, Path("/m")).specs[0].connector_extra for f in plan.families}
    assert extras == {
        "upstream-pull": {},
        "kvpush-push": {},
        "kvpush-step": {"push_granularity": "step"},
        "kvpush-thread": {"progress": "thread"},
    }
    decode = suite_cpu.pair_family(suite_cpu.CANDIDATES[1], Path("/m")).decodes[0]
    assert decode.connector_extra == {"progress": "thread"}, "thread progress runs on both sides"
