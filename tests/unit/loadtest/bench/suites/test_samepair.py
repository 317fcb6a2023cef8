"""The same-pair suite: its plan (push pairs only, light points capped) and how one point loads both fronts."""

from pathlib import Path
from typing import Any

import pytest

from loadtest.bench import run as bench
from loadtest.bench.fronts import Front
from loadtest.bench.point import Point
from loadtest.bench.suites import samepair as suite_samepair
from loadtest.bench.suites.cpu import FAMILIES
from stack.engines import Engine, EngineSpec, Role

PORTS: tuple[tuple[Role, int], ...] = (
    ("prefill", 18001),
    ("decode", 18002),
)  # never bound: the engines are handles, not started


def test_both_push_pairs_by_default_and_a_pull_pair_is_refused() -> None:
    assert suite_samepair.FULL.pairs == ("upstream-push", "kvpush-push")
    assert bench.with_overrides(suite_samepair.FULL, ["pairs=kvpush-push"]).pairs == ("kvpush-push",)
    for value in ("upstream-pull", ""):
        with pytest.raises(ValueError, match="known: upstream-push, kvpush-push"):
            bench.with_overrides(suite_samepair.FULL, [f"pairs={value}"])


def test_light_points_are_capped_by_time_at_half_the_rate_per_front() -> None:
    plan = suite_samepair.FULL  # 60 requests per front, at most 120 s of each front's half rate
    assert [plan.n_for(q) for q in (1.0, 3.0, 8.0)] == [60, 60, 60]
    short = bench.with_overrides(plan, ["max_point_s=20"])
    assert [short.n_for(q) for q in (0.2, 1.0, 3.0)] == [3, 10, 30]


def test_one_point_loads_every_front_together_taking_one_arrival_stream_in_turn_with_distinct_prompts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[list[Point]] = []

    def together(points: list[Point], run_dir: Path, summary: Path, progress: bool) -> list[dict[str, Any]]:
        seen.append(points)
        return [{"router": p.labels.router} for p in points]

    monkeypatch.setattr(suite_samepair, "measure_together", together)
    fam = next(f for f in FAMILIES if f.label == "kvpush-push")
    p, d = (Engine(EngineSpec(role, role, tmp_path, http_port=port), log_dir=tmp_path) for role, port in PORTS)
    fronts = [
        (Front(r, fam.mode, f"http://{r}", None, p.url, d.url, fam.label), {"concurrent": True})
        for r in ("kvpush", "vllm-router")
    ]
    plan = suite_samepair.FULL
    rows = suite_samepair._point(fronts, plan, 3.0, 1, 2, "run", tmp_path, tmp_path / "s.json", False)
    assert rows == [{"router": "kvpush"}, {"router": "vllm-router"}]
    (points,) = seen
    assert [pt.base_url for pt in points] == ["http://kvpush", "http://vllm-router"]
    assert {pt.labels.qps for pt in points} == {3.0}  # the pair's load, one stream ...
    assert len({pt.seed for pt in points}) == 1  # ... taken in turn: the same seed, a phase each
    assert [(pt.stride, pt.phase) for pt in points] == [(2, 0), (2, 1)]
    assert len({pt.salt for pt in points}) == 2
    assert all(pt.salt for pt in points)  # never 0: that would mean "from the clock", the same for both
    assert [pt.router_timings for pt in points] == [True, False]
    assert all(pt.decode_url == d.url and pt.tokenizer_url == p.url for pt in points)
    assert all(pt.extra["repeat"] == 2 and pt.extra["front_qps"] == 1.5 for pt in points)


def test_the_suite_refuses_to_run_without_vllm_router(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(suite_samepair, "vrouter_binary", lambda: None)
    with pytest.raises(RuntimeError, match="vllm-router not found"):
        suite_samepair.run(suite_samepair.SMOKE, tmp_path, tmp_path / "s.json", False, "run")
