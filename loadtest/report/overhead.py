"""The overhead part of bench/README.md: fronts on zero-cost workers (min/median/max over repeats), the issue 9
targets (kvpush push vs vllm-router push), how the legs reached the workers, and the router's profile."""

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.report.kit import Agg, Verdict, agg, agg_of, group, verdict_table
from loadtest.results import Row

# The router's one leg client and one HTTP server. Rows of older runs record `leg_client` and `server`: those runs
# also measured the aiohttp legs and granian, both deleted since (bench/ANALYSIS.md, "Options deleted"); such a row
# is still shown, as its own front.
LEG_CLIENT, SERVER = "http1", "uvicorn"


def _scored(rows: Sequence[Row]) -> list[Row]:
    """Unprofiled rows; a kvpush row of an old run on another leg client or HTTP server is its own front in the
    tables (`kvpush (aiohttp legs)`, `kvpush (granian)`, `kvpush (granian, aiohttp legs)`), so the targets compare
    the router as it ships with vllm-router."""
    return [_front(r) for r in rows if not r.get("profiled")]


def _front(row: Row) -> Row:
    if row.get("router") != "kvpush":
        return row
    client, server, tracing = row.get("leg_client"), row.get("server"), row.get("tracing")
    tags = [] if server in (None, SERVER) else [str(server)]
    tags += [] if client in (None, LEG_CLIENT) else [f"{client} legs"]
    tags += [] if tracing in (None, "off") else ["A/A control" if tracing == CONTROL else f"tracing {_label(tracing)}"]
    return {**row, "router": f"kvpush ({', '.join(tags)})"} if tags else row


def _added(rows: Sequence[Row], direct: Sequence[Row], name: str) -> Agg | None:
    """TTFT `name` minus direct's median at the same concurrency, per repeat."""
    base = agg(direct, "ttft_ms", name)
    if base is None:
        return None
    return agg_of(rows, lambda r: None if not r.get("ttft_ms") else float(r["ttft_ms"][name]) - base.med)


def _t(a: Agg | None, digits: int = 2, signed: bool = False) -> str:
    """median (min-max) over the repeats; just the value for a single run."""
    if a is None:
        return "-"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f.format(a.med) if a.k == 1 else f"{f.format(a.med)} ({f.format(a.lo)} to {f.format(a.hi)})"


def _wire(rs: Sequence[Row]) -> str:
    kinds: dict[str, int] = {}
    gaps = []
    for r in rs:
        w = r.get("wire_order") or {}
        for k, v in (w.get("d_kinds") or {}).items():
            kinds[k] = kinds.get(k, 0) + int(v)
        if w.get("d_after_p_ms_p50") is not None:
            gaps.append(float(w["d_after_p_ms_p50"]))
    if not kinds:
        return "-"
    gap = f", D {min(gaps):.2f}-{max(gaps):.2f} ms after P" if gaps else ""
    return " ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + gap


def table(rows: Sequence[Row]) -> list[str]:
    direct = group([r for r in rows if r["router"] == "direct"], "concurrency")
    out = [
        "| conc | front | mode | repeats | failed | TTFT p50 | added TTFT p50 | added TTFT p99 | req/s "
        "| CPU s / 1k req | peak RSS MiB | D legs (kind), D after P |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (conc, router, mode), rs in sorted(group(rows, "concurrency", "router", "mode").items()):
        d = direct.get((conc,), [])
        out.append(
            f"| {conc} | {router} | {mode} | {len(rs)} | {sum(int(r['failed']) for r in rs)} "
            f"| {_t(agg(rs, 'ttft_ms', 'p50'))} | {_t(_added(rs, d, 'p50'), signed=True)} "
            f"| {_t(_added(rs, d, 'p99'), signed=True)} "
            f"| {_t(agg(rs, 'req_per_s', ''), 0)} | {_t(agg(rs, 'cpu_s_per_1k', ''))} "
            f"| {_t(agg(rs, 'peak_rss_mb', ''), 0)} | {_wire(rs)} |"
        )
    return out


def verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """Issue 9's overhead targets, on medians over the repeats (kvpush push vs vllm-router push)."""
    direct = group([r for r in rows if r["router"] == "direct"], "concurrency")
    by = group(rows, "concurrency", "router", "mode")
    levels = sorted({int(r["concurrency"]) for r in rows if r.get("concurrency") is not None})
    out: list[Verdict] = []

    def med(a: Agg | None) -> float | None:
        return None if a is None else a.med

    if 1 in levels:
        d = direct.get((1,), [])
        mine = med(_added(by.get((1, "kvpush", "push"), []), d, "p50"))
        ref = med(_added(by.get((1, "vllm-router", "push"), []), d, "p50"))
        out.append(
            Verdict("added TTFT p50 <= vllm-router push + 0.2 ms", "c=1", mine, ref, None if ref is None else ref + 0.2)
        )
    for mode in ("push", "pull"):
        for c in levels:
            ours_rows, their_rows = by.get((c, "kvpush", mode), []), by.get((c, "vllm-router", mode), [])
            ref = med(agg(their_rows, "cpu_s_per_1k", ""))
            out.append(
                Verdict(
                    f"CPU / 1k req <= 1.0x vllm-router {mode}",
                    f"c={c}",
                    med(agg(ours_rows, "cpu_s_per_1k", "")),
                    ref,
                    ref,
                    unit="s",
                )
            )
    best: dict[str, float | None] = {}
    for key, router in (("ours", "kvpush"), ("theirs", "vllm-router")):
        vals = [a.med for c in levels if (a := agg(by.get((c, router, "push"), []), "req_per_s", "")) is not None]
        best[key] = max(vals) if vals else None
    out.append(
        Verdict(
            "max req/s >= vllm-router push", "all levels", best["ours"], best["theirs"], best["theirs"], False, "req/s"
        )
    )
    if 64 in levels:
        d = direct.get((64,), [])
        p99_ours = med(_added(by.get((64, "kvpush", "push"), []), d, "p99"))
        p99_theirs = med(_added(by.get((64, "vllm-router", "push"), []), d, "p99"))
        out.append(Verdict("added TTFT p99 <= vllm-router push", "c=64", p99_ours, p99_theirs, p99_theirs))
    return out


def tracing_lines(rows: Sequence[Row]) -> list[str]:
    """Issue 23's tracing cost: each traced kvpush push front's CPU per request against the untraced one's, per
    concurrency, from the same run (fronts interleaved); nothing when the run traced no front."""
    untraced = (None, "off", CONTROL)
    traced = sorted({str(r["tracing"]) for r in rows if r.get("tracing") not in untraced}, key=float, reverse=True)
    if not traced:
        return []
    push = [r for r in rows if r.get("router") == "kvpush" and r.get("mode") == "push" and not r.get("profiled")]
    by = group(push, "concurrency", "tracing")
    out = [
        "### Tracing overhead (issue 23)",
        "",
        f"Run {rows[0].get('run_id', '?')} (commit {str(rows[0].get('git_commit', '?'))[:7]}, "
        f"{max(int(r.get('repeat', 0)) for r in rows) + 1} repeat(s), the overhead load): "
        "kvpush push with OpenTelemetry tracing on (OTLP/gRPC to a sink that drops the spans; sampler "
        "parentbased_traceidratio at the ratio shown) against the same router untraced, in the same run. CPU is "
        "the router process's own, the export thread included (off-loop threads: the export thread's and gRPC's CPU, "
        "read per thread, exact where the process's total is not); medians of the repeats (min-max). Targets: at most "
        "10 % more CPU per request at 100 % sampling, 2 % at 1 %. Paired: each repeat's traced front against the "
        "untraced one of the same repeat (measured minutes apart, not across the run: the box's load drifts), "
        "median (min-max) of the repeats; the spread is the noise a single cell carries. `control` is a second "
        "untraced router measured the same way (an A/A pair): its difference from `off` is the noise floor. The "
        "process's CPU is read when the load ends, before the last batch of spans is exported; the per-thread table "
        "below reads the export threads after it, so judge the targets there.",
        "",
        "| conc | tracing | CPU s / 1k req | more than untraced (median) | paired, per repeat | "
        "off-loop threads us / req | added TTFT p50 vs untraced (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for conc in sorted({int(c) for c, _ in by}):
        base_rows = by.get((conc, "off"), [])
        base = agg(base_rows, "cpu_s_per_1k", "")
        base_ttft = agg(base_rows, "ttft_ms", "p50")
        out.append(f"| {conc} | off | {_t(base)} | - | - | {_side(base_rows)} | - |")
        for ratio in [CONTROL, *traced] if by.get((conc, CONTROL)) else traced:
            rs = by.get((conc, ratio), [])
            cpu, ttft = agg(rs, "cpu_s_per_1k", ""), agg(rs, "ttft_ms", "p50")
            more = "-" if cpu is None or base is None else f"{100 * (cpu.med / base.med - 1):+.1f} %"
            added = "-" if ttft is None or base_ttft is None else f"{ttft.med - base_ttft.med:+.2f}"
            paired = _paired(rs, base_rows)
            side = _side(rs)
            out.append(f"| {conc} | {_label(ratio)} | {_t(cpu)} | {more} | {paired} | {side} | {added} |")
    out += _thread_lines(by, traced)
    note = (
        "A run without a `control` row has no noise floor of its own (two identical untraced routers have differed "
        "by 3-4 % in earlier runs). Where the extra CPU goes, thread by thread and in a profile: bench/ANALYSIS.md "
        '(tracing) and router/README.md, "Tracing\'s cost".'
    )
    return [*out, "", note, ""]


CONTROL = "control"  # the overhead suite's second untraced router (loadtest/bench/suites/overhead.py)
LOOP = "loop_thread_us_per_req"
SIDE = "side_threads_us_per_req"


def _thread_lines(by: dict[Any, list[Row]], traced: Sequence[str]) -> list[str]:
    """The same points per thread (schedstat, ns: no 10 ms ticks): the event loop's CPU per request, the other
    threads', their sum, and the sum's paired ratio to the untraced front of the same repeat; nothing when the
    rows carry no loop-thread figure (runs before it was recorded)."""
    if not any(r.get(LOOP) is not None for rs in by.values() for r in rs):
        return []
    out = [
        "",
        "Per thread (each router thread's CPU from /proc/<pid>/task/<tid>/schedstat, in ns, around each point, "
        "warm-up included; us per request, median (min-max) of the repeats; paired as above, on the threads' sum):",
        "",
        "| conc | tracing | loop thread | off-loop threads | all threads | all threads, paired, per repeat |",
        "|---|---|---|---|---|---|",
    ]
    for conc in sorted({int(c) for c, _ in by}):
        base_rows = by.get((conc, "off"), [])
        for ratio in ("off", CONTROL, *traced):
            rs = by.get((conc, ratio), [])
            if not rs and ratio == CONTROL:
                continue
            label = _label(ratio)
            paired = "-" if ratio == "off" else _paired(_summed(rs), _summed(base_rows), "threads_us")
            cells = " | ".join(_spread([float(r[k]) for r in rs if r.get(k) is not None]) for k in (LOOP, SIDE))
            total = _spread([float(r["threads_us"]) for r in _summed(rs)])
            out.append(f"| {conc} | {label} | {cells} | {total} | {paired} |")
    return out


def _label(tracing: str) -> str:
    """A tracing setting as the tables show it: off, control (A/A), or the sampling percentage."""
    if tracing == CONTROL:
        return "off (control, A/A)"
    return "off" if tracing == "off" else f"{float(tracing) * 100:g} %"


def _summed(rows: Sequence[Row]) -> list[Row]:
    """The rows with both per-thread figures, each with their sum as `threads_us`."""
    return [
        {**r, "threads_us": float(r[LOOP]) + float(r[SIDE])}
        for r in rows
        if r.get(LOOP) is not None and r.get(SIDE) is not None
    ]


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _side(rows: Sequence[Row]) -> str:
    """The median CPU per request of the router's threads besides its event loop (export, gRPC), in us."""
    values = [float(r["side_threads_us_per_req"]) for r in rows if r.get("side_threads_us_per_req") is not None]
    return f"{statistics.median(values):.1f}" if values else "-"


def _paired(traced: Sequence[Row], untraced: Sequence[Row], key: str = "cpu_s_per_1k") -> str:
    """Each repeat's traced CPU per request (`key`) over the untraced one's of the same repeat: median (min to max)."""
    base: dict[Any, float] = {r.get("repeat"): float(r[key]) for r in untraced if r.get(key)}
    ratios = sorted(
        100 * (float(r[key]) / base[r.get("repeat")] - 1)
        for r in traced
        if r.get(key) is not None and base.get(r.get("repeat"))
    )
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):+.1f} % ({ratios[0]:+.1f} to {ratios[-1]:+.1f})"


def profile_lines(path: Path | None) -> list[str]:
    """router-profile.json (overhead suite with --set cprofile=true), if one was written."""
    if path is None or not path.exists():
        return [
            "No router profile yet: `kvpush bench --suite overhead --set cprofile=true --set repeats=1 "
            "--set levels=1:300,64:1500` writes bench/results/router-profile.json."
        ]
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    out = [
        f"cProfile of the kvpush push router (commit {str(data.get('git_commit', '?'))[:12]}, run "
        f"{data.get('run_id', '?')}) over {data['requests']} requests of the overhead load, warm-up included (self "
        "time per category; cProfile slows Python code several-fold, so read the shares):",
        "",
        "| category | ms / request (profiled) | share |",
        "|---|---|---|",
    ]
    for k, v in data["per_request_ms"].items():
        out.append(f"| {k} | {v:.3f} | {100 * data['share'].get(k, 0.0):.1f} % |")
    out += ["", "Top functions by self time (ms per request, profiled):", ""]
    out += [f"- {ms:.3f} `{name}`" for name, ms in data["top"][:10]]
    return out


def overhead_section(rows: Sequence[Row], results_dir: Path | None = None, tracing: Sequence[Row] = ()) -> list[str]:
    """`rows`: the latest overhead run; `tracing`: the latest run that measured tracing (its own table)."""
    if not rows:
        return ["No overhead run yet."]
    scored = _scored(rows)
    reps = max(int(r.get("repeat", 0)) for r in rows) + 1
    return [
        "Zero-cost simulated workers (profile `zero`), closed loop at each concurrency, "
        f"{rows[0]['input_len']}-token prompts, {rows[0]['output_len']} streamed tokens, {reps} repeat(s) per "
        "point with the fronts' order rotated: cells are median (min-max). Added = front minus direct-to-decode's "
        "median at the same concurrency. CPU and RSS are the front door's own process group. Push fronts sit on a "
        "P that answers like a push prefill (`transfer_mode: push`), so vllm-router learns the push identity; "
        "`D legs` says how the legs reached the workers: `push` = D was not given P's block ids (sent before P "
        "answered: concurrent), `pull` = after P's answer.",
        "",
        *table(scored),
        "",
        "### Issue 9 targets (overhead, medians of repeats)",
        "",
        *verdict_table(verdicts(scored)),
        "",
        *tracing_lines(tracing),
        "### Where the router's time goes",
        "",
        *profile_lines(None if results_dir is None else results_dir / "router-profile.json"),
        "",
        "![overhead](results/overhead.png)",
    ]
