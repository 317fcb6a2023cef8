"""`loadtest bench`: run the suites, append their rows to summary.json, redraw plots and bench/README.md.

Every suite is a module with FULL and SMOKE plans and `run(plan, run_dir, summary, progress, run_id)` (the
shape is in loadtest/README.md), named in `loadtest.bench.suites.SUITES` and imported when run.
"""

import dataclasses
import datetime as dt
import importlib
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from loadtest.bench.suites import SUITES
from loadtest.job import REPO
from loadtest.report import plots, readme
from loadtest.results import latest, latest_what_if, load_rows
from stack.procs import StartupError


def suite_module(name: str) -> ModuleType:
    """The suite's module (imported now: a suite pulls in the stack only when it runs)."""
    return importlib.import_module(SUITES[name])


def _parse(text: str, like: Any) -> Any:
    if isinstance(like, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{text!r} is not a boolean")
        return text.lower() in ("true", "1", "yes")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    if isinstance(like, tuple):
        items = [t for t in text.split(",") if t.strip()]
        sample = like[0] if like else 0.0
        if isinstance(sample, tuple):  # pairs such as (qps, requests) as 0.5:24,1.5:40
            return tuple(tuple(_parse(x, s) for x, s in zip(t.split(":"), sample, strict=True)) for t in items)
        return tuple(_parse(t.strip(), sample) for t in items)
    return text


def with_overrides(plan: Any, overrides: Sequence[str], strict: bool = True) -> Any:
    """`plan` with FIELD=VALUE overrides applied (dataclasses.replace); unknown fields raise when `strict`."""
    names = {f.name for f in dataclasses.fields(plan)}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        if key not in names:
            if strict:
                raise ValueError(f"--set {key}: not a field of {type(plan).__name__} ({', '.join(sorted(names))})")
            continue
        changes[key] = _parse(value, getattr(plan, key))
    return dataclasses.replace(plan, **changes)


def _check_overrides(names: Sequence[str], smoke: bool, overrides: Sequence[str]) -> None:
    """With several suites, each override must name a field of at least one of their plans."""
    plans = [getattr(suite_module(n), "SMOKE" if smoke else "FULL") for n in names]
    fields = {f.name for p in plans for f in dataclasses.fields(p)}
    for item in overrides:
        key = item.partition("=")[0].strip().replace("-", "_")
        if key not in fields:
            raise ValueError(f"--set {key}: not a field of any plan of {', '.join(names)}")


def fresh(rows: Sequence[dict[str, Any]], suite: str, run_id: str) -> list[dict[str, Any]]:
    """The suite's latest rows when they are this run's, else none: a suite that failed, or wrote its rows under
    another name (multiturn on a link: `multiturn-link`), must not redraw its plots from an older run."""
    mine = latest(rows, suite)
    return mine if mine and mine[0].get("run_id") == run_id else []


def run_suites(
    suite: str,
    *,
    smoke: bool,
    results: Path | None,
    progress: bool,
    profile: str | None = None,
    overrides: Sequence[str] = (),
) -> int:
    """Run one suite or all; 0 when every suite ran (its rows may still count failed requests).

    `profile` swaps the seed-sim profile for a what-if one; the report keeps such runs apart from the headline.
    `overrides` are FIELD=VALUE changes to the suites' plans (sweep size: QPS points, requests, repeats).
    """
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + ("-smoke" if smoke else "")
    results_dir = results or (REPO / "bench" / "runs" / "smoke" if smoke else REPO / "bench" / "results")
    summary = results_dir / "summary.json"
    run_dir = REPO / "bench" / "runs" / run_id
    names = tuple(SUITES) if suite == "all" else (suite,)
    _check_overrides(names, smoke, overrides)
    failed: list[str] = []
    for name in names:
        module = suite_module(name)
        plan = with_overrides(getattr(module, "SMOKE" if smoke else "FULL"), overrides, strict=len(names) == 1)
        print(f"== {name} ({'smoke' if smoke else 'full'}) run {run_id}: {plan}; data and logs in {run_dir}")
        try:
            extra = (profile,) if name == "seed-sim" and profile else ()
            rows = module.run(plan, run_dir, summary, progress, run_id, *extra)
            print(f"== {name}: {len(rows)} rows -> {summary}")
        except (StartupError, OSError, RuntimeError, ValueError, httpx.HTTPError):
            traceback.print_exc()
            print(f"== {name}: FAILED (see above and the logs in {run_dir / 'logs'})")
            failed.append(name)
    rows_all = load_rows(summary)
    for name in names:
        for path in plots.suite_plots(name, fresh(rows_all, name, run_id), results_dir):
            print(f"   plot {path}")
        what_if = latest_what_if(rows_all) if name == "seed-sim" else []
        for path in plots.suite_plots(name, what_if, results_dir, prefix="seed-sim-whatif"):
            print(f"   plot {path}")
    results_dir.mkdir(parents=True, exist_ok=True)
    readme_path = results_dir / "README.md" if smoke or results is not None else REPO / "bench" / "README.md"
    readme_path.write_text(readme.render(rows_all, results_dir), encoding="utf-8")
    print(f"== report {readme_path}")
    return 1 if failed else 0
