"""Runs the rows, checks each bed settles clean afterwards, and writes matrix.json and the README table."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.faults.bed import (
    DECODE_TP_SHAPE,
    DP_SHAPE,
    KV_TIMEOUT_S,
    LINK_SHAPE,
    PREEMPT_SHAPE,
    REPO,
    TP_SHAPE,
    Bed,
    BedShape,
    standin_bed,
    vllm_bed,
)
from loadtest.faults.dp import DP
from loadtest.faults.events import EVENTS, EVENTS_SHAPE
from loadtest.faults.link import LINK
from loadtest.faults.ranks import RANKS
from loadtest.faults.residual import RESIDUAL
from loadtest.faults.rows import FaultRow, selected
from loadtest.faults.scenarios import SCENARIOS, FaultOutcome
from loadtest.faults.sustained import SUSTAINED
from stack.link.access import LinkUnavailable

logger = logging.getLogger("kvpush.faults")
SETTLE_S = 90.0  # longest wait for a bed to settle (leases: 30 s on P, the bed's kv_timeout_s 30 s on D)
OUT = REPO / "bench" / "faults"
# Settings each bed's router runs with: defaults, except the admission bound for the burst row and, for the
# never-reading prefill, a short prefill deadline (the default 300 s would make the row take 5 minutes).
VLLM_CONFIG: dict[str, Any] = {"max_in_flight": 8, "admission_queue": 8, "admission_wait": 2.0}
STANDIN_CONFIG: dict[str, dict[str, Any]] = {"never-read": {"timeouts": {"prefill": 5.0}}}
# The vLLM beds, in the order they run: the plain one, the preemption bed (a chunked prefill, a small cache), the
# rank bed (a TP=2 prefill), the link bed (engines in namespaces behind a shaped link).
VLLM_SHAPES: dict[str, BedShape] = {
    "vllm": BedShape(),
    "vllm-preempt": PREEMPT_SHAPE,
    "vllm-tp": TP_SHAPE,
    "vllm-dp": DP_SHAPE,
    "vllm-dtp": DECODE_TP_SHAPE,
    "vllm-events": EVENTS_SHAPE,
    "vllm-link": LINK_SHAPE,
}


@dataclass(frozen=True)
class Form:
    """How a run is laid out. The table's form runs one bed at a time on a quiet machine, with the connector's
    default lease and the bed's `kv_timeout_s`, so its times mean something; the test's form (`TEST_FORM`) checks
    the same rows for the same verdict in less time: the stand-in rows run while the vLLM bed's engines start
    (their times then include a busy machine), and P's lease and D's hold deadline are shorter, so a row whose
    prefill kept finished blocks nobody registered for, or whose decode quarantined blocks of a killed prefill,
    settles in seconds (the row still waits until they are freed)."""

    overlap: bool = False  # stand-in rows while the vLLM bed starts
    lease_s: float | None = None  # P's lease on the vLLM bed; None: the connector's default (30 s)
    kv_timeout_s: float = KV_TIMEOUT_S  # D's hold deadline on the vLLM bed


TABLE_FORM = Form()
TEST_FORM = Form(overlap=True, lease_s=10.0, kv_timeout_s=15.0)


@dataclass
class After:
    """What the bed shows once the row is over (after waiting up to SETTLE_S for it to settle)."""

    settled: bool
    settle_s: float
    router: dict[str, float]
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines_at_once: dict[str, dict[str, Any]] = field(default_factory=dict)  # the first look, right after


@dataclass
class RowResult:
    row: dict[str, Any]
    outcome: dict[str, Any]
    after: dict[str, Any]
    clean: bool  # nothing stuck, no counter held, no KV block in use, every client served or clearly refused
    within_deadline: bool


def observe(bed: Bed, timeout: float = SETTLE_S) -> After:
    t0 = time.monotonic()
    deadline = t0 + timeout
    first: dict[str, dict[str, Any]] | None = None
    with httpx.Client() as http:
        while True:
            gauges = bed.router.gauges(http)
            states = {w.name: w.state(http) for w in bed.workers}
            first = first or {name: asdict(s) for name, s in states.items()}
            quiet = all(v == 0 for v in gauges.values()) and all(s.idle for s in states.values())
            if quiet or time.monotonic() > deadline:
                engines = {name: asdict(s) for name, s in states.items()}
                return After(quiet, round(time.monotonic() - t0, 2), gauges, engines, first)
            time.sleep(0.25)


def run_row(bed: Bed, row: FaultRow) -> RowResult:
    logger.info("fault row: %s", row.name)
    try:
        outcome = {**SCENARIOS, **SUSTAINED, **RANKS, **DP, **EVENTS, **RESIDUAL, **LINK}[row.fault](bed, row)
    except Exception as exc:  # a row that breaks is a result, and the rest still run
        logger.exception("fault row %s failed to run", row.name)
        outcome = FaultOutcome(f"row failed to run: {type(exc).__name__}: {exc}", False, float("inf"))
    after = observe(bed)
    return RowResult(
        row=asdict(row),
        outcome={**asdict(outcome), "fault_to_outcome_s": round(outcome.fault_to_outcome_s, 2)},
        after=asdict(after),
        clean=after.settled and outcome.acceptable,
        within_deadline=outcome.fault_to_outcome_s <= row.deadline_s,
    )


def unavailable(row: FaultRow, reason: str) -> RowResult:
    """A row whose bed could not be made here: not clean, with the reason as its outcome."""
    outcome = {"summary": f"not run: {reason}", "acceptable": False, "fault_to_outcome_s": float("inf"), "note": ""}
    after = asdict(After(False, 0.0, {"in_flight": 0.0, "queued": 0.0, "worker_in_flight": 0.0}))
    return RowResult(row=asdict(row), outcome=outcome, after=after, clean=False, within_deadline=False)


def run(
    rows: Iterable[FaultRow], progress: Callable[[RowResult], None] = lambda _: None, form: Form = TABLE_FORM
) -> list[RowResult]:
    rows = list(rows)
    results: dict[str, RowResult] = {}
    on_vllm = [r for r in rows if r.bed in VLLM_SHAPES]
    with tempfile.TemporaryDirectory(prefix="kvpush-faults-") as kv, ThreadPoolExecutor(1) as side:

        def standins() -> None:
            for row in (r for r in rows if r.bed == "standin"):
                faulty, ok = [row.fault, "ok"], ["ok"]
                prefills, decodes = (faulty, ok) if row.target == "prefill" else (ok, faulty)
                with standin_bed(prefills, decodes, STANDIN_CONFIG.get(row.fault, {}), Path(kv)) as bed:
                    results[row.name] = run_row(bed, row)
                    progress(results[row.name])

        pending: Future[None] | None = side.submit(standins) if form.overlap and on_vllm else None
        if pending is None:
            standins()
        try:
            for name, shape in VLLM_SHAPES.items():  # one vLLM bed at a time, each for its own rows
                mine = [r for r in on_vllm if r.bed == name]
                if not mine:
                    continue
                try:
                    with vllm_bed(VLLM_CONFIG, form.lease_s, form.kv_timeout_s, shape) as bed:
                        for row in mine:
                            results[row.name] = run_row(bed, row)
                            progress(results[row.name])
                except LinkUnavailable as exc:  # no root and no user namespace: the link rows say so, the rest run
                    for row in mine:
                        results[row.name] = unavailable(row, str(exc))
                        progress(results[row.name])
        finally:
            if pending is not None:
                pending.result()  # the stand-in rows are done (their beds stopped) before the folder goes
    return [results[r.name] for r in rows if r.name in results]


def _commit() -> str:
    if os.environ.get("KVPUSH_COMMIT"):
        return os.environ["KVPUSH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(results: list[RowResult], out: Path, short: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": _commit(), "short": short, "host": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M")}
    (out / "matrix.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in results]}, indent=2))
    (out / "README.md").write_text(readme(results, meta))


def _engines(engines: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name, s in engines.items():
        if not s["alive"]:
            parts.append(f"{name}: dead")
            continue
        kv = "" if s["kv_usage"] is None else f", kv {s['kv_usage']:.2%}"
        running = "?" if s["running"] is None else f"{s['running']:g}"
        parts.append(f"{name}: {running} running{kv}")
    return "; ".join(parts)


def readme(results: list[RowResult], meta: Mapping[str, Any]) -> str:
    lines = [
        "# Fault matrix",
        "",
        "Written by `python -m loadtest.faults` (`make faults`; `--short` is the form `make test` runs as",
        "tests/integration/faults/test_fault_matrix.py). Each row injects one fault into a live stack and records",
        "what the clients got, the time from the fault to their last outcome (for a client that leaves: until the",
        "router released the request), and afterwards (waiting up to "
        f"{SETTLE_S:g} s) the router's gauges and every engine's",
        "running + waiting requests and KV usage. *Clean*: every client was served or got a clear OpenAI-style",
        "error, and nothing is left running, held or in use. Bed `vllm`: two prefill and one decode vLLM CPU",
        f"engines (tiny model, our push connector with `kv_timeout_s` {KV_TIMEOUT_S:g} s, default 120) behind a"
        " router with default settings except",
        f"`{json.dumps(VLLM_CONFIG)}`; bed `standin`: loadtest/faults/hostile_workers.py processes"
        " (the first worker of the faulty role misbehaves), router defaults except "
        f"`{json.dumps(STANDIN_CONFIG)}`.",
        "",
        f"Run: commit `{meta['commit']}`, {meta['when']} UTC, {'short' if meta['short'] else 'full'} form, on a",
        "shared 2-core machine (times are indicative).",
        "",
        "| fault | bed | what | client outcome | fault → outcome (s) | deadline (s) | router after "
        "(in flight / queued / legs) | engines after | settled after (s) | clean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        row, outcome, after = r.row, r.outcome, r.after
        router = after["router"]
        gauges = f"{router['in_flight']:g} / {router['queued']:g} / {router['worker_in_flight']:g}"
        seconds = outcome["fault_to_outcome_s"]
        time_cell = f"{seconds:.2f}" + ("" if r.within_deadline else " (over)")
        lines.append(
            f"| {row['name']} | {row['bed']} | {row['what']} | {outcome['summary']} | {time_cell} | "
            f"{row['deadline_s']:g} | {gauges} | {_engines(after['engines'])} | {after['settle_s']:g} | "
            f"{'yes' if r.clean else '**no**'} |"
        )
    notes = [f"- {r.row['name']}: {r.outcome['note']}" for r in results if r.outcome.get("note")]
    slow = [
        f"- {r.row['name']}: took {r.after['settle_s']:g} s to settle; right after the outcome: "
        f"{_engines(r.after.get('engines_at_once') or {}) or '(not recorded)'}"
        for r in results
        if r.after["settled"] and r.after["settle_s"] > 10
    ]
    unsettled = [
        f"- {r.row['name']}: did not settle within {SETTLE_S:g} s (values above are at the deadline)"
        for r in results
        if not r.after["settled"]
    ]
    lines += ["", f"{sum(r.clean for r in results)} of {len(results)} rows clean.", ""]
    lines += ["Notes:", *notes, *slow, *unsettled] if notes or slow or unsettled else []
    return "\n".join(lines) + "\n"


def rows_for(short: bool) -> tuple[FaultRow, ...]:
    return selected(short)
