"""Suite "multiturn": multi-turn chat sessions on real vLLM CPU engines (one prefill, two decodes, prefix caching
on), through several fronts in turn with the same sessions and arrival times:

- kvpush with the session-affinity decider (push; short uncached suffixes bypass prefill on the decode that holds
  the conversation);
- kvpush without a decider (push, every turn prefilled and transferred whole);
- vllm-router 0.1.17 in push mode (it detects push from prefill's `transfer_mode`) with `consistent_hash` on
  X-Session-ID for decode (when its binary is installed: `make bench` puts it in .venv-vrouter).

P runs on core 0, both decodes share core 1. Every engine reports cached tokens per request
(--enable-prompt-tokens-details) and runs with VLLM_SERVER_DEV_MODE=1, so the prefix caches are reset
(POST /reset_prefix_cache) before each front: no front profits from an earlier front's turns. The plan's `repeats`
(2 by default) each take new sessions (seed + repeat) and, every other time, the fronts in reverse order, so that
drift on the shared cores shows as spread between repeats (loadtest/report/multiturn.py folds them: median and
range, targets judged on the ratio within each repeat). One row per front and repeat (rows.py):
TTFT per turn index, TTFT over turns >= 2, TPOT, decode's prompt tokens by source (both decodes summed), the
share of an ideal router's reusable tokens that were local cache hits on decode, how many answers equal the
first front's (greedy: all must) and, for a kvpush front, the decider's bypass predictions within 20 % of the
actual uncached tokens (its router's kvpush_bypass_accurate / kvpush_bypass_checked counters at the end of the
run; issue 11's target: >= 90 % of bypass decisions) and each bypass's prediction against decode's count
(checks.py). A PNG of TTFT p50 by turn goes next to summary.json.

Three suites share this run: on loopback ("multiturn"); on a link (`link=<preset>`, "multiturn-link": link.py);
with router replicas (`replicas=2..4`, "multiturn-replicas": the engines publish their KV events and the fronts
are the decider's with events on behind one router and behind the replicas, taking a conversation's turns in
turn: replicas.py; on a link too). Modules: plan.py (the plan and engines), fronts.py (starting each front's
routers, one loadtest.bench.fronts.Front per router), readings.py (what is read around a front's run), rows.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from loadtest import multiturn
from loadtest.bench.procs import vllm_lock
from loadtest.bench.suites.multiturn import checks as checks_mod
from loadtest.bench.suites.multiturn import fronts as fronts_mod
from loadtest.bench.suites.multiturn import readings
from loadtest.bench.suites.multiturn import replicas as replicas_mod
from loadtest.bench.suites.multiturn.link import calibrated, maybe_link
from loadtest.bench.suites.multiturn.plan import (
    DETAILS,
    FRONTS,
    FULL,
    SMOKE,
    MultiTurnPlan,
    decider_yaml,
    engine_family,
    on_link,
    warmup,
)
from loadtest.bench.suites.multiturn.readings import bypass_accuracy, grown
from loadtest.bench.suites.multiturn.rows import FrontRun, row
from loadtest.report import multiturn as report_multiturn
from loadtest.results import append_rows
from stack.engines import Engine, Fleet
from stack.family import start_family
from stack.link.meter import NicMeter
from stack.local import StackOptions, ensure_model
from stack.tiny_model import SIZES

__all__ = [
    "DETAILS",
    "FRONTS",
    "FULL",
    "SMOKE",
    "MultiTurnPlan",
    "bypass_accuracy",
    "decider_yaml",
    "engine_family",
    "grown",
    "on_link",
    "run",
    "warmup",
]


def run(plan: MultiTurnPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=plan.model_size))
    rows: list[dict[str, Any]] = []
    per_token = SIZES[plan.model_size].kv_bytes_per_token()
    base_env = fronts_mod.env() | {"VLLM_SERVER_DEV_MODE": "1"}
    with vllm_lock(), maybe_link(plan) as link, Fleet(logs, base_env=base_env) as fleet:
        family = start_family(fleet, engine_family(plan, model), timeout=600.0, link=link)
        engines, p, decodes = list(family.members), family.prefills[0], list(family.decodes)
        link_record: dict[str, Any] = {}
        if link is not None:
            plan, link_record = calibrated(plan, link, p.url)
        ratio = readings.words_per_token(p.url)
        fronts = plan.fronts
        d_urls = [d.url for d in decodes]
        started = {f: fronts_mod.start(f, plan, fleet, p, d_urls, logs, run_dir, model) for f in fronts}
        for routers in started.values():
            if routers is not None and plan.warmup_sessions:
                asyncio.run(multiturn.run_sessions(_targets(routers, ratio, plan), warmup(plan)))
        for repeat in range(plan.repeats):
            shape = plan.shape(repeat)
            sessions, prefix = multiturn.plan_sessions(shape), multiturn.session_prefix(shape.seed)
            order = fronts if repeat % 2 == 0 else tuple(reversed(fronts))
            ran: dict[str, FrontRun] = {}
            checked: dict[str, dict[str, Any]] = {}
            for front in order:
                routers = started[front]
                if routers is not None:
                    meter = NicMeter(link, p.engine_spec.name) if link is not None else None
                    ran[front] = _run_front(front, routers, plan, sessions, prefix, engines, decodes, ratio, progress)
                    checked[front] = dict(link_record)
                    if meter is not None:
                        kv = int(ran[front].sources.get("external_kv_transfer", 0.0)) * per_token
                        checked[front].update(meter.check(kv).record())
            one, many = ran.get(replicas_mod.EVENTS), ran.get(replicas_mod.REPLICAS)
            if one is not None and many is not None and one.modes is not None and many.modes is not None:
                many.same_route = replicas_mod.same_route(one.modes, many.modes)
            baseline = ran[fronts[0]].turns if fronts[0] in ran else []
            for front in fronts:
                if front in ran:
                    rows.append(row(plan, ran[front], baseline, repeat, run_id, run_dir, checked[front]))
            if plan.replicas > 1 and repeat == plan.repeats - 1:
                _stop_one(replicas_mod.REPLICAS, started.get(replicas_mod.REPLICAS), decodes[-1], rows)
    append_rows(summary, rows)
    report_multiturn.plot_ttft_by_turn(rows, summary.parent / f"{plan.suite}-ttft-by-turn.png")
    return rows


def _stop_one(name: str, routers: fronts_mod.Routers | None, engine: Engine, rows: list[dict[str, Any]]) -> None:
    """The run is over: stop one decode and note on the last replicas row how soon every replica's view of it
    emptied (replicas.stop_reflected)."""
    if routers is None:
        return
    found = replicas_mod.stop_reflected(engine, [r.base for r in routers])
    print(f"multiturn: {engine.engine_spec.name} stopped: {found}")
    mine = [one for one in rows if one.get("front") == name]
    if mine:
        mine[-1]["engine_stop_reflected"] = found


def _targets(routers: fronts_mod.Routers, ratio: float, plan: MultiTurnPlan) -> list[multiturn.Target]:
    return [multiturn.Target(r.base, "tiny", ratio, plan.timeout_s) for r in routers]


def _run_front(
    name: str,
    routers: fronts_mod.Routers,
    plan: MultiTurnPlan,
    sessions: list[multiturn.Session],
    prefix: str,  # the sessions' id prefix: their requests among the router's records
    engines: list[Engine],
    decodes: list[Engine],
    ratio: float,
    progress: bool,
) -> FrontRun:
    kvpush, bases, pids = fronts_mod.is_kvpush(name), [r.base for r in routers], fronts_mod.pids(routers)
    readings.reset_caches(engines)
    if replicas_mod.uses_events(name):
        settled = replicas_mod.settle_views([e.url for e in engines], bases)
        print(f"multiturn {name}: views empty after the reset in {settled} s (None: not within 10 s)")
    before, counted = readings.decode_sources(decodes), readings.accuracy(bases) if kvpush else None
    read = replicas_mod.read(bases, pids) if kvpush else None
    turns, duration = asyncio.run(multiturn.run_sessions(_targets(routers, ratio, plan), sessions))
    after = readings.decode_sources(decodes)
    if progress:
        print(f"multiturn {name}: {sum(t.rec.ok for t in turns)}/{len(turns)} turns ok in {duration:.1f} s")
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    accuracy = grown(counted, readings.accuracy(bases)) if kvpush else None
    served = readings.summed_counts(readings.routes(base, prefix) for base in bases) if kvpush else None
    by_replica = [replicas_mod.replica_routes(base, prefix) for base in bases] if kvpush else None
    modes = [replicas_mod.modes(base, prefix) for base in bases] if kvpush else None
    checks = None
    if logs := fronts_mod.decider_logs(name, routers):
        bypassed = set().union(*(checks_mod.bypass_ids(base, prefix) for base in bases))
        checks = checks_mod.verdict(checks_mod.logged_checks(logs, prefix), bypassed)
        print(f"multiturn {name}: bypass checks {checks}")
    events = None
    if read is not None:
        done = replicas_mod.read(bases, pids)
        events = replicas_mod.figures(read, done, duration, len(turns), len(bases))
        if replicas_mod.uses_events(name):
            events["reset_reflected"] = replicas_mod.reset_reflected(decodes[0].url, bases)
        if progress:
            print(f"multiturn {name}: {events}")
    return FrontRun(name, turns, duration, sources, served, accuracy, len(bases), events, by_replica, checks, modes)
