"""One summary.json row per front and repeat of the multiturn suite (the section: loadtest/report/multiturn.py
and multiturn_replicas.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest import multiturn
from loadtest.bench.suites.multiturn import replicas as replicas_mod
from loadtest.bench.suites.multiturn.plan import MultiTurnPlan
from loadtest.job import REPO
from loadtest.records import write_jsonl
from loadtest.results import RowLabels, build_row, git_commit
from loadtest.stats import summarize


@dataclass
class FrontRun:
    front: str
    turns: list[multiturn.TurnRecord]
    duration: float
    sources: dict[str, float]  # decode's prompt tokens by source during this front's run
    routes: dict[str, int] | None  # kvpush fronts: how its router served this run's turns
    accuracy: dict[str, int] | None  # the decider's bypass counters' growth during this run
    replicas: int = 1
    events: dict[str, Any] | None = None  # kvpush fronts: router CPU and KV-event figures (replicas.py)
    by_replica: list[dict[str, int]] | None = None  # kvpush fronts: each replica's turns and bypasses
    bypass_checks: dict[str, Any] | None = None  # decider fronts: each bypass's prediction (checks.py)
    modes: list[dict[str, str]] | None = None  # kvpush fronts: each router's route per request id
    same_route: list[dict[str, int]] | None = None  # the replicas front: per replica, turns routed as one router


def row(
    plan: MultiTurnPlan,
    ran: FrontRun,
    baseline: list[multiturn.TurnRecord],
    repeat: int,
    run_id: str,
    run_dir: Path,
    more: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One front's row; `more`: the link's record and bytes check, when on a link."""
    front, turns, sources = ran.front, ran.turns, ran.sources
    where = run_dir / f"{plan.suite}-{front}-r{repeat}"
    multiturn.write_turns(where / "turns.jsonl", turns)
    write_jsonl(where / "requests.jsonl", [t.rec for t in turns])
    figures = multiturn.by_turn(turns)
    ideal = figures["ideal_reusable_tokens"]
    equal, compared = multiturn.answers_agree(turns, baseline)
    extra: dict[str, Any] = {
        "run_id": run_id,
        "front": front,
        "repeat": repeat,
        "decider": "session-affinity" if front.startswith("kvpush-decider") else None,
        "replicas": ran.replicas,
        "kv_events": replicas_mod.uses_events(front),
        "answer_tokenizer": replicas_mod.uses_events(front)
        and plan.answer_tokenizer
        and front != replicas_mod.ESTIMATE,
        "model": plan.model_size,
        "plan": asdict(plan),
        "decode_prompt_tokens_by_source": sources,
        "local_hit_frac_of_ideal": sources.get("local_cache_hit", 0.0) / ideal if ideal else None,
        "answers_equal_first_front": [equal, compared],
        "errors": sorted({t.rec.error for t in turns if t.rec.error})[:5],
        "records": _relative(where / "requests.jsonl"),  # RequestRecord lines (CDF plots)
        "turn_records": _relative(where / "turns.jsonl"),  # + session, turn, answer
        "routes": ran.routes,
        "bypass_by_replica": ran.by_replica,
        "bypass_accuracy": ran.accuracy,
        "bypass_checks": ran.bypass_checks,
        "same_route_as_one_router": ran.same_route,
        **figures,
        **(ran.events or {}),
        **(more or {}),
    }
    labels = RowLabels(
        plan.suite,
        "vllm-router" if front.startswith("vllm-router") else "kvpush",
        "push",
        plan.connector,
        plan.session_rate,
        None,
        (plan.message_min + plan.message_max) // 2,
        (plan.answer_min + plan.answer_max) // 2,
        extra,
    )
    return build_row(summarize([t.rec for t in turns], ran.duration), labels, git_commit(REPO))


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
