"""`loadtest bench`: run the suites, append their rows to summary.json, redraw plots and bench/README.md."""

import datetime as dt
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest import plots, report, suite_cpu, suite_overhead, suite_seed
from loadtest.job import REPO
from loadtest.results import SUITES, load_rows
from stack.procs import StartupError

Runner = Callable[[bool, Path, Path, bool, str, str | None], list[dict[str, Any]]]


def _seed(
    smoke: bool, run_dir: Path, summary: Path, progress: bool, run_id: str, profile: str | None
) -> list[dict[str, Any]]:
    plan = suite_seed.SMOKE if smoke else suite_seed.FULL
    return suite_seed.run(plan, run_dir, summary, progress, run_id, profile or suite_seed.PROFILE)


def _cpu(
    smoke: bool, run_dir: Path, summary: Path, progress: bool, run_id: str, profile: str | None
) -> list[dict[str, Any]]:
    return suite_cpu.run(suite_cpu.SMOKE if smoke else suite_cpu.FULL, run_dir, summary, progress, run_id)


def _overhead(
    smoke: bool, run_dir: Path, summary: Path, progress: bool, run_id: str, profile: str | None
) -> list[dict[str, Any]]:
    plan = suite_overhead.SMOKE if smoke else suite_overhead.FULL
    return suite_overhead.run(plan, run_dir, summary, progress, run_id)


RUNNERS: dict[str, Runner] = {"seed-sim": _seed, "cpu-vllm": _cpu, "overhead": _overhead}


def run_suites(suite: str, *, smoke: bool, results: Path | None, progress: bool, profile: str | None = None) -> int:
    """Run one suite or all; 0 when every suite ran (its rows may still count failed requests).

    `profile` swaps the seed-sim profile for a what-if one; the report keeps such runs apart from the headline.
    """
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + ("-smoke" if smoke else "")
    results_dir = results or (REPO / "bench" / "runs" / "smoke" if smoke else REPO / "bench" / "results")
    summary = results_dir / "summary.json"
    run_dir = REPO / "bench" / "runs" / run_id
    names = SUITES if suite == "all" else (suite,)
    failed: list[str] = []
    for name in names:
        print(f"== {name} ({'smoke' if smoke else 'full'}) run {run_id}; per-request data and logs in {run_dir}")
        try:
            rows = RUNNERS[name](smoke, run_dir, summary, progress, run_id, profile)
            print(f"== {name}: {len(rows)} rows -> {summary}")
        except (StartupError, OSError, RuntimeError, ValueError, httpx.HTTPError):
            traceback.print_exc()
            print(f"== {name}: FAILED (see above and the logs in {run_dir / 'logs'})")
            failed.append(name)
    rows_all = load_rows(summary)
    for name in names:
        for path in plots.suite_plots(name, report.latest(rows_all, name), results_dir):
            print(f"   plot {path}")
        what_if = report.latest_what_if(rows_all) if name == "seed-sim" else []
        for path in plots.suite_plots(name, what_if, results_dir, prefix="seed-sim-whatif"):
            print(f"   plot {path}")
    readme = results_dir / "README.md" if smoke or results is not None else REPO / "bench" / "README.md"
    readme.write_text(report.render(rows_all), encoding="utf-8")
    print(f"== report {readme}")
    return 1 if failed else 0
