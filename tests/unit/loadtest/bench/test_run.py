"""bench's suite registry and --set overrides (pure: no suite is run)."""

import dataclasses

import pytest

from loadtest.bench import run as bench
from loadtest.bench.suites import SUITES


@dataclasses.dataclass(frozen=True)
class Plan:
    qps: tuple[float, ...] = (1.0,)
    points: tuple[tuple[float, int], ...] = ((0.5, 10),)
    repeats: int = 2
    label: str = "x"
    calibrate: bool = True


def test_overrides_parse_by_the_fields_current_type() -> None:
    p = bench.with_overrides(Plan(), ["qps=0.5,4,8", "points=0.5:24,3:40", "repeats=3", "label=y", "calibrate=false"])
    assert p == Plan((0.5, 4.0, 8.0), ((0.5, 24), (3.0, 40)), 3, "y", False)
    assert isinstance(p.points[0][1], int)


def test_unknown_fields_raise_when_strict_and_are_skipped_otherwise() -> None:
    with pytest.raises(ValueError, match="not a field"):
        bench.with_overrides(Plan(), ["nope=1"])
    assert bench.with_overrides(Plan(), ["nope=1"], strict=False) == Plan()
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        bench.with_overrides(Plan(), ["repeats"])


def test_every_suite_in_the_one_table_has_a_module_with_plans_and_run() -> None:
    assert set(SUITES) == {"seed-sim", "cpu-vllm", "same-pair", "overhead", "multiturn", "link", "link-wire"}
    for name in SUITES:
        mod = bench.suite_module(name)
        assert hasattr(mod, "FULL") and hasattr(mod, "SMOKE") and hasattr(mod, "run")


def test_suite_plans_are_dataclasses_so_set_can_size_them() -> None:
    for name in ("seed-sim", "cpu-vllm", "same-pair", "overhead"):
        mod = bench.suite_module(name)
        assert dataclasses.is_dataclass(mod.FULL) and dataclasses.is_dataclass(mod.SMOKE)


def test_only_a_suite_whose_latest_rows_are_this_runs_redraws_its_plots() -> None:
    old = {"suite": "multiturn", "run_id": "r0", "created": "2026-12-01T00:00:00"}
    moved = {"suite": "multiturn-link", "run_id": "r1", "created": "2026-12-04T00:00:00"}
    assert bench.fresh([old, moved], "multiturn", "r1") == []
    assert bench.fresh([old, moved], "multiturn-link", "r1") == [moved]
    assert bench.fresh([], "link", "r1") == []
