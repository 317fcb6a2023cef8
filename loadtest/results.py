"""Rows of bench/results/summary.json: the schema, building a row from a Summary, appending atomically."""

import datetime as dt
import json
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import machine
from loadtest.stats import Summary

Row = dict[str, Any]  # one row of summary.json
ROUTERS = ("kvpush", "vllm-router", "direct")
MODES = ("push", "pull", "direct")
CONNECTORS = (
    "upstream-push",
    "upstream-pull",
    "kvpush-push",
    "kvpush-progressive",
    "kvpush-layer",
    "kvpush-step",
    "kvpush-thread",
    "sim",
)  # a new row's connector; older rows may name "kvpush-layer-chunked", "kvpush-steppoll" (deleted: bench/ANALYSIS.md)
REQUIRED = (
    "suite",
    "router",
    "mode",
    "connector",
    "qps",
    "concurrency",
    "input_len",
    "output_len",
    "n",
    "failed",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "handoff_ms",
    "req_per_s",
    "git_commit",
    "created",
)


@dataclass(frozen=True)
class RowLabels:
    """What a run was: which suite, which front door, which transfer mode and connector, at which load."""

    suite: str
    router: str
    mode: str
    connector: str
    qps: float | None
    concurrency: int | None
    input_len: int
    output_len: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.suite:  # the suites' names: loadtest.bench.suites.SUITES (the bench room, above this one)
            raise ValueError("a row needs a suite")
        for value, allowed in (
            (self.router, ROUTERS),
            (self.mode, MODES),
            (self.connector, CONNECTORS),
        ):
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {allowed}")


def git_commit(repo: Path) -> str:
    """HEAD's hash, with '-dirty' when tracked files under loadtest/ or router/ differ; 'unknown' outside git."""
    base = ["git", "-C", str(repo)]
    paths = ["--", "loadtest", "router"]
    try:
        head = subprocess.run([*base, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        status = [*base, "status", "--porcelain", "--untracked-files=no", *paths]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def build_row(summary: Summary, labels: RowLabels, commit: str, now: dt.datetime | None = None) -> dict[str, Any]:
    created = (now or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds")
    row: dict[str, Any] = {
        "suite": labels.suite,
        "router": labels.router,
        "mode": labels.mode,
        "connector": labels.connector,
        "qps": None if labels.qps is None or labels.qps == float("inf") else labels.qps,
        "concurrency": labels.concurrency,
        "input_len": labels.input_len,
        "output_len": labels.output_len,
        "n": summary.n,
        "failed": summary.failed,
        "ttft_ms": summary.ttft_ms,
        "tpot_ms": summary.tpot_ms,
        "itl_ms": summary.itl_ms,
        "e2e_ms": summary.e2e_ms,
        "handoff_ms": summary.handoff_ms,
        "req_per_s": summary.req_per_s,
        "output_tok_per_s": summary.output_tok_per_s,
        "total_tok_per_s": summary.total_tok_per_s,
        "goodput_req_per_s": summary.goodput_req_per_s,
        "duration_s": summary.duration_s,
        "git_commit": commit,
        "created": created,
        "machine": machine.describe(),
    }
    row.update(labels.extra)
    return {k: clean(v) for k, v in row.items()}


def clean(v: Any) -> Any:
    """NaN and infinities become null (JSON has neither); dicts are cleaned one level down."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    return v


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8") or "[]")
    if not isinstance(data, list):
        raise ValueError(f"{path} is not a JSON list")
    return data


def append_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Read, extend, write to a temp file and rename: a crash never leaves half a file."""
    current = load_rows(path)
    current.extend(dict(r) for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(current, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)


A_PRIORI = "qwen3-32b-h200"  # the seed-sim headline profile; runs on any other profile are what-ifs


def _what_if(row: Row) -> bool:
    return row.get("suite") == "seed-sim" and row.get("profile") not in (None, A_PRIORI)


def latest(rows: Sequence[Row], suite: str) -> list[Row]:
    """Rows of the newest run_id of a suite (run ids are UTC stamps, so they sort by time); what-ifs,
    profiling runs (overhead with cprofile: the profiled router is slowed) and tracing runs (overhead with
    traced fronts: `latest_tracing`) excluded."""
    mine = [
        r
        for r in rows
        if r.get("suite") == suite
        and r.get("run_id")
        and not _what_if(r)
        and not r.get("profiling_run")
        and not r.get("tracing_run")
    ]
    if not mine:
        return []
    newest = max(str(r["run_id"]) for r in mine)
    return [r for r in mine if r["run_id"] == newest]


def latest_tracing(rows: Sequence[Row]) -> list[Row]:
    """Rows of the newest overhead run that measured tracing (`--set tracings=...`: traced kvpush fronts)."""
    mine = [r for r in rows if r.get("tracing_run") and r.get("run_id") and not r.get("profiling_run")]
    if not mine:
        return []
    newest = max(str(r["run_id"]) for r in mine)
    return [r for r in mine if r["run_id"] == newest]


def latest_what_if(rows: Sequence[Row]) -> list[Row]:
    """Rows of the newest seed-sim run on a what-if profile."""
    mine = [r for r in rows if _what_if(r) and r.get("run_id")]
    if not mine:
        return []
    newest = max(str(r["run_id"]) for r in mine)
    return [r for r in mine if r["run_id"] == newest]
