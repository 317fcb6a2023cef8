"""One measured point of a suite: a load run against a front, its row in summary.json, and what the workers
saw (KV sources, simulator fidelity, the order the legs arrived in)."""

import asyncio
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest import promtext
from loadtest.arrivals import ArrivalSpec
from loadtest.bench import procs
from loadtest.bench.block_runs import block_runs
from loadtest.job import REPO, Job, execute, execute_together
from loadtest.results import RowLabels, append_rows, build_row, git_commit
from loadtest.runner import LoadConfig, RunResult
from loadtest.stats import Summary, paired_ttft


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[promtext.Sample, float]:
    resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return promtext.parse(resp.text)


def kv_sources(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, float]:
    """Prompt tokens the decode engine got per source over a run (vllm:prompt_tokens_by_source_total delta)."""
    name = "vllm:prompt_tokens_by_source_total"
    b, a = promtext.by_label(before, name, "source"), promtext.by_label(after, name, "source")
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(set(a) | set(b))}


def sim_fidelity(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, float]:
    """A simulator's real-vs-modeled step time over a run: mean lag per step (ms) and lag / modeled time."""
    d = {
        k: promtext.total(after, f"kvpush_sim_{k}") - promtext.total(before, f"kvpush_sim_{k}")
        for k in ("steps_total", "modeled_seconds_total", "lag_seconds_total")
    }
    if d["steps_total"] <= 0:
        return {}
    out = {"lag_ms_per_step": 1000 * d["lag_seconds_total"] / d["steps_total"]}
    if d["modeled_seconds_total"] > 0:
        out["lag_frac"] = d["lag_seconds_total"] / d["modeled_seconds_total"]
    return out


def kv_external_frac(sources: Mapping[str, float]) -> float | None:
    total = sum(sources.values())
    return None if total <= 0 else sources.get("external_kv_transfer", 0.0) / total


@dataclass(frozen=True)
class Point:
    """One measured run of a suite: where to send, how much, and how to label the row."""

    labels: RowLabels
    base_url: str
    n: int
    seed: int
    warmup: int = 2
    tokenizer: str = "synthetic"
    tokenizer_url: str | None = None
    router_timings: bool = False
    decode_url: str | None = None  # scrape its /metrics before and after (KV arrived by transfer?)
    prefill_url: str | None = None  # a simulated P: scrape its loop fidelity too
    writer_url: str | None = None  # our connector's P: scrape how its WRITEs' block ids ran (block_runs)
    timeout_s: float = 300.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    legs_of: tuple[str, str] | None = None  # simulated (P, D) URLs: record how the front door sent the legs
    stride: int = 1  # > 1: one arrival per block of `stride` of the label's stream (fronts in turn; ArrivalSpec)
    phase: int = 0
    salt: int = 0  # the prompts' salt (0: from the clock); fronts loaded together need distinct ones


def _name(point: Point) -> str:
    lab = point.labels
    rep = point.extra.get("repeat", lab.extra.get("repeat"))
    name = f"{lab.suite}-{lab.router}-{lab.mode}-{lab.connector}-q{lab.qps}-c{lab.concurrency}"
    name += f"-r{rep}" if rep is not None else ""
    for key in ("tracing", "kv_events"):  # two kvpush fronts traced or following KV events (the overhead suite's)
        value = point.extra.get(key, lab.extra.get(key))
        name += f"-{key}-{value}" if value not in (None, "off") else ""
    return name


def _job(point: Point, run_dir: Path, progress: bool) -> Job:
    lab, name = point.labels, _name(point)
    load = LoadConfig(
        base_url=point.base_url,
        model="",
        input_len=lab.input_len,
        output_len=lab.output_len,
        num_requests=point.n,
        arrivals=ArrivalSpec(lab.qps or float("inf"), 1.0, point.seed, point.stride, point.phase),
        concurrency=lab.concurrency,
        warmup=point.warmup,
        timeout_s=point.timeout_s,
        request_id_prefix=f"{lab.suite}-{lab.mode}-{point.seed}",
    )
    return Job(
        load=load,
        tokenizer=point.tokenizer,
        tokenizer_url=point.tokenizer_url,
        salt=point.salt,
        router_timings=point.router_timings,
        out_dir=run_dir / name,
        progress=sys.stderr if progress else None,
        label=name,
    )


def measure(
    point: Point,
    run_dir: Path,
    summary_path: Path,
    progress: bool,
    cpu_pid: int | None = None,
    finish: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    loaded: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one point, append its row to summary_path and return the row (per-request JSONL under run_dir).
    `finish`, when given, is called once the load is done with the row's extra fields so far (KV sources
    included) and returns more fields for the row (the link suite's measured transfer and bytes check).
    `loaded`, when given, is called the moment the load is done, with the front's CPU reading: before the harness
    asks the router anything (its GET /debug/timings, a few ms of the router's CPU, is no request's cost)."""
    before = scrape(point.decode_url) if point.decode_url else None
    p_before = scrape(point.prefill_url) if point.prefill_url else None
    w_before = scrape(point.writer_url) if point.writer_url else None
    cpu: list[float] = []  # the front's CPU seconds before the load and once it is done
    job = _job(point, run_dir, progress)
    if cpu_pid:
        # read before the router timings are fetched: serving GET /debug/timings is the harness's cost

        def on_loaded() -> None:
            cpu.append(procs.group_cpu_seconds(cpu_pid))
            if loaded is not None:
                loaded()

        job = replace(job, on_loaded=on_loaded)
        cpu.append(procs.group_cpu_seconds(cpu_pid))
    since = time.monotonic()
    result, summary = asyncio.run(execute(job))
    extra: dict[str, Any] = dict(point.labels.extra) | dict(point.extra)
    if cpu_pid is not None and len(cpu) == 2:
        done = max(summary.n + point.warmup, 1)
        extra["cpu_s_per_1k"] = (cpu[1] - cpu[0]) / done * 1000
        extra["peak_rss_mb"] = procs.group_peak_rss_mb(cpu_pid)
    if p_before is not None and point.prefill_url:
        extra["sim_prefill_fidelity"] = sim_fidelity(p_before, scrape(point.prefill_url))
    if before is not None and point.decode_url:
        extra.update(_decode_extra(before, scrape(point.decode_url)))
    if w_before is not None and point.writer_url and (runs := block_runs(w_before, scrape(point.writer_url))):
        extra["block_runs"] = runs
    if point.legs_of is not None:
        extra.update(wire_order_or_note(point.legs_of, since))
    if finish is not None:
        extra.update(finish(extra))
    row = _row(point, result, summary, extra, run_dir)
    append_rows(summary_path, [row])
    return row


def measure_together(
    points: Sequence[Point], run_dir: Path, summary_path: Path, progress: bool
) -> list[dict[str, Any]]:
    """Load several fronts at the same time, each on its own prompts (give the points distinct salts) and its
    arrivals (distinct seeds, or one seed and stride = the number of fronts, a phase each: the fronts then take
    one arrival stream in turn, so consecutive arrivals meet the same engines); one row per front. Every
    decode's /metrics are read once around the whole run, so a row's KV sources are its decode's, counting the
    requests of every front on it (`kv_sources: "shared"`). Two fronts in turn also get `paired_ttft`."""
    names = [_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ValueError(f"measure_together: fronts need distinct labels, got {names}")
    decodes = sorted({p.decode_url for p in points if p.decode_url})
    before = {d: scrape(d) for d in decodes}
    done = asyncio.run(execute_together([_job(p, run_dir, progress) for p in points]))
    after = {d: scrape(d) for d in decodes}
    in_turn = len(points) == 2 and all(p.stride == 2 for p in points) and points[0].seed == points[1].seed
    rows = []
    for k, (point, (result, summary)) in enumerate(zip(points, done, strict=True)):
        extra: dict[str, Any] = dict(point.labels.extra) | dict(point.extra)
        if point.decode_url:
            extra.update(_decode_extra(before[point.decode_url], after[point.decode_url]))
            extra["kv_sources"] = "shared"
        if in_turn and (paired := paired_ttft(result.records, done[1 - k][0].records)) is not None:
            extra["paired_ttft"] = paired | {"with": points[1 - k].labels.router}
        rows.append(_row(point, result, summary, extra, run_dir))
    append_rows(summary_path, rows)
    return rows


def _decode_extra(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if fid := sim_fidelity(before, after):
        extra["sim_decode_fidelity"] = fid
    sources = kv_sources(before, after)
    extra["decode_prompt_tokens_by_source"] = sources
    extra["kv_external_frac"] = kv_external_frac(sources)
    return extra


def _row(point: Point, result: RunResult, summary: Summary, extra: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    lab, name = point.labels, _name(point)
    extra["load_started_unix"], extra["load_s"] = result.started_unix, result.duration_s
    extra["errors"] = sorted({r.error for r in result.records if r.error})[:5]
    records = run_dir / name / "requests.jsonl"
    extra["records"] = str(records.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(records)
    labels = RowLabels(
        lab.suite, lab.router, lab.mode, lab.connector, lab.qps, lab.concurrency, lab.input_len, lab.output_len, extra
    )
    return build_row(summary, labels, git_commit(REPO))


def legs(base_url: str, timeout_s: float = 10.0) -> list[tuple[str, str, float]]:
    """A simulator's leg log: (handoff key, leg kind, CLOCK_MONOTONIC at arrival) per generation request."""
    resp = httpx.get(base_url.rstrip("/") + "/debug/legs", timeout=timeout_s)
    resp.raise_for_status()
    return [(str(k), str(kind), float(t)) for k, kind, t in resp.json()["legs"]]


def wire_order_or_note(
    legs_of: tuple[str, str], since: float, read: Callable[[str], list[tuple[str, str, float]]] | None = None
) -> dict[str, Any]:
    """{"wire_order": ...} from the simulated (P, D)'s leg logs (`read`: `legs` by default); when either cannot be
    read (a starved simulator past the timeout, a dead one), {"wire_order": None, "wire_order_note": why}, so
    one point's missing leg log does not end the run."""
    read = read or legs
    try:
        return {"wire_order": wire_order(read(legs_of[0]), read(legs_of[1]), since)}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        note = f"/debug/legs unreadable: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"bench.point: {note}; the row records no wire order", file=sys.stderr)
        return {"wire_order": None, "wire_order_note": note}


def wire_order(
    p_legs: Sequence[tuple[str, str, float]], d_legs: Sequence[tuple[str, str, float]], since: float
) -> dict[str, Any]:
    """How a front door sent the two legs of each request since `since` (monotonic), seen by the workers.

    `d_after_p_ms`: D's leg arrival minus P's leg arrival, per request joined by handoff key (p50/max); a
    concurrent front door sends D's leg well before P answers. `d_kinds`: D's legs by kind ("push" = D was not
    given P's block ids, i.e. it did not wait for P's answer; "pull" = it did).
    """
    p_at = {k: t for k, kind, t in p_legs if t >= since and kind == "prefill"}
    gaps = sorted(1000 * (t - p_at[k]) for k, kind, t in d_legs if t >= since and k in p_at)
    kinds: dict[str, int] = {}
    for _, kind, t in d_legs:
        if t >= since:
            kinds[kind] = kinds.get(kind, 0) + 1
    out: dict[str, Any] = {"joined": len(gaps), "d_kinds": kinds}
    if gaps:
        out["d_after_p_ms_p50"] = gaps[len(gaps) // 2]
        out["d_after_p_ms_max"] = gaps[-1]
    return out
