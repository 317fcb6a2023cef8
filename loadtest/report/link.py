"""The link suite's part of bench/README.md (issue 21 items 5 and 6), pure: one table per step (prompt length x
preset) with the link's rate, the measured prefill and transfer times and the bytes check; the targets; the
multi-turn run on a link; and the simulator's predictions against the measured rows (report/linksim.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from loadtest.report import linksim
from loadtest.report import multiturn as report_multiturn
from loadtest.report.kit import Verdict, agg, agg_of, cell, fmt, group, kv_ext_pct, median, verdict_table
from loadtest.results import Row

HEADLINE = "ethernet-100g-like"
EFA = "efa-like"
UNSHAPED = "unshaped"  # stack/link/plan.py: the same namespaces and TCP, no rate limit (the efa check's in-run control)
MT_LINK = "ethernet-25g-like"
PROG, OURS, UP, PULL = "kvpush-progressive", "kvpush-push", "upstream-push", "upstream-pull"
LAYER = "kvpush-layer"  # push_granularity: layer, a candidate until 2026-12-07 (now the default: kvpush-push is)
STEP = "kvpush-step"  # push_granularity: step, the default until 2026-12-07 (a candidate since)
LAYERC = "kvpush-layer-chunked"  # layer-wise in chunks: deleted, worst of the three; older runs' rows still show
OVERLAPS = {
    OURS: "ours (product default)",
    PROG: "progressive",
    LAYER: "layer-wise",
    LAYERC: "layer-wise chunked",
    STEP: "step-wise",
}  # judged against the targets
FRONT_ORDER = (
    ("kvpush", PULL),
    ("kvpush", UP),
    ("vllm-router", UP),
    ("kvpush", OURS),
    ("kvpush", PROG),
    ("kvpush", LAYER),
    ("kvpush", LAYERC),
    ("kvpush", STEP),
)


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


BENCH_MODEL = "bench"  # the suites' model (stack/tiny_model.py); rows before the `model` field ran it too


def model_of(r: Row) -> str:
    return str(r.get("model") or BENCH_MODEL)


Step = tuple[int, str, str]  # prompt length, preset, model


def steps(rows: Sequence[Row]) -> list[Step]:
    """(prompt length, preset, model) in the order the run measured them."""
    seen: list[Step] = []
    for r in sorted(rows, key=lambda r: str(r.get("created") or "")):
        key = (int(r["input_len"]), str(r.get("link")), model_of(r))
        if key not in seen:
            seen.append(key)
    return seen


def headline_run(rows: Sequence[Row]) -> list[Row]:
    """The link run the section leads with: the newest one on the bench model (the model of the loopback runs and
    of every target so far) that measured the targets' preset (HEADLINE), else the newest on the bench model, else
    the newest of any; a newer run on another model, or of other presets only (an efa-like rerun), is shown after."""
    runs = [r for r in rows if r.get("suite") == "link" and r.get("run_id")]
    bench = [r for r in runs if model_of(r) == BENCH_MODEL]
    with_targets = {str(r["run_id"]) for r in bench if r.get("link") == HEADLINE}
    pool = [r for r in bench if str(r["run_id"]) in with_targets] or bench or runs
    if not pool:
        return []
    run_id = max(str(r["run_id"]) for r in pool)
    return [r for r in pool if str(r["run_id"]) == run_id]


def of_step(rows: Iterable[Row], step: Step) -> list[Row]:
    n, preset, model = step
    return [r for r in rows if int(r["input_len"]) == n and r.get("link") == preset and model_of(r) == model]


def _front_key(r: Row) -> int:
    key = (r.get("router"), r.get("connector"))
    return FRONT_ORDER.index(key) if key in FRONT_ORDER else len(FRONT_ORDER)


def bytes_ratio(r: Row) -> float | None:
    kv, tx = _f(r.get("link_kv_bytes")), _f(r.get("link_nic_tx_bytes"))
    return None if not kv or tx is None else tx / kv


def row_ok(r: Row) -> bool:
    """No failed request, the bytes check passed, every prompt token to D by transfer, outputs as one instance."""
    eq = r.get("outputs_equal_single") or [0, 0]
    ext = kv_ext_pct(r)
    return (
        int(r.get("failed") or 0) == 0
        and r.get("link_bytes_ok") is True
        and ext is not None
        and ext >= 99.5
        and eq[0] == eq[1]
    )


def step_table(rows: Sequence[Row]) -> list[str]:
    """One line per (QPS, front): medians over the repeats (min-max)."""
    out = [
        "| QPS | front | connector | reps | n | failed | TTFT mean | TTFT p50 | TPOT mean | handoff p50 "
        "| transfer measured (ms) | P's NIC / KV bytes | bytes check | KV ext % "
        "| outputs = 1 instance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    grouped = group(rows, "qps", "router", "connector")
    for (qps, router, conn), rs in sorted(grouped.items(), key=lambda kv: (kv[0][0], _front_key(kv[1][0]))):
        ok = sum(1 for r in rs if r.get("link_bytes_ok") is True)
        eq = [sum(int((r.get("outputs_equal_single") or [0, 0])[i]) for r in rs[:1]) for i in (0, 1)]
        out.append(
            f"| {qps:g} | {router} | {conn} | {len(rs)} | {sum(int(r['n']) for r in rs)} "
            f"| {sum(int(r['failed']) for r in rs)} | {cell(agg(rs, 'ttft_ms', 'mean'))} "
            f"| {cell(agg(rs, 'ttft_ms', 'p50'))} | {cell(agg(rs, 'tpot_ms', 'mean'))} "
            f"| {cell(agg(rs, 'handoff_ms', 'p50'))} | {cell(agg_of(rs, lambda r: _f(r.get('xfer_ms_mean'))))} "
            f"| {cell(agg_of(rs, bytes_ratio), 3)} | {ok}/{len(rs)} ok "
            f"| {cell(agg_of(rs, kv_ext_pct), 0)} | {eq[0]}/{eq[1]} |"
        )
    return out


def step_header(rows: Sequence[Row]) -> str:
    """The link as calibrated for this step: preset, rate, measured prefill, wire time of one prompt."""
    r = rows[0]
    rate = _f(r.get("link_rate_bit_s"))
    times = ", ".join(f"{1000 * float(t):.0f}" for t in (r.get("link_prefill_times_s") or []))
    wire = _f(r.get("link_expected_transfer_s"))
    faithful = "" if r.get("link_faithful") else " (above the ~5 Gbit/s this box shapes faithfully: a ceiling)"
    model = "" if model_of(r) == BENCH_MODEL else f", model `{model_of(r)}`"
    return (
        f"**{r.get('link')}, {r['input_len']}-token prompts{model}**: tbf "
        f"{'-' if rate is None else f'{rate / 1e6:.1f} Mbit/s'}{faithful}, set from P's measured prefill "
        f"{fmt(None if (p := _f(r.get('link_prefill_s'))) is None else 1000 * p, 0)} ms (runs: {times} ms); "
        f"one prompt's KV ({int(r.get('link_prompt_kv_bytes') or 0) / 2**20:.0f} MiB) takes "
        f"{fmt(None if wire is None else 1000 * wire, 0)} ms on the wire."
    )


def _med(rows: Iterable[Row], metric: str, name: str) -> float | None:
    a = agg(rows, metric, name)
    return None if a is None else a.med


def _lim(ref: float | None, k: float) -> float | None:
    return None if ref is None else k * ref


def headline_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """ethernet-100g-like, the first prompt length: each of our overlapping pushes (progressive, layer-wise, both)
    that ran against pull and upstream push (kvpush front)."""
    head = [r for r in rows if r.get("headline") and r.get("router") == "kvpush"]
    by = group(head, "qps", "connector")
    out: list[Verdict] = []
    for conn, label in OVERLAPS.items():
        for qps in sorted({float(r["qps"]) for r in head}):
            ours, pull, up = by.get((qps, conn), []), by.get((qps, PULL), []), by.get((qps, UP), [])
            if not ours:
                continue
            point = f"{qps:g} QPS"
            mean = _med(ours, "ttft_ms", "mean")
            ref = _med(pull, "ttft_ms", "mean")
            out.append(Verdict(f"{label} TTFT mean <= 0.6x pull", point, mean, ref, _lim(ref, 0.6)))
            ref = _med(up, "ttft_ms", "mean")
            out.append(Verdict(f"{label} TTFT mean <= 0.8x upstream push", point, mean, ref, _lim(ref, 0.8)))
            ref = _med(pull, "tpot_ms", "mean")
            out.append(Verdict(f"{label} TPOT mean <= pull", point, _med(ours, "tpot_ms", "mean"), ref, ref))
    return out


def paired_ratios(rows: Sequence[Row], conn: str, ref: str, metric: str = "mean") -> list[float]:
    """Progressive (or `conn`) over `ref` TTFT within each repeat of a point (kvpush front)."""
    per: dict[tuple[Any, Any], dict[str, float]] = {}
    for r in rows:
        if r.get("router") == "kvpush" and (v := (r.get("ttft_ms") or {}).get(metric)) is not None:
            per.setdefault((r["qps"], r.get("repeat")), {})[str(r["connector"])] = float(v)
    return [d[conn] / d[ref] for _, d in sorted(per.items()) if conn in d and d.get(ref)]


def newest_efa(latest_rows: Sequence[Row], earlier: Sequence[Row] = ()) -> list[Row]:
    """The efa-like rows on the bench model of the newest link run that has them (the latest, else an earlier one):
    what the loopback check judges."""
    for rows in (latest_rows, earlier):
        efa = [r for r in rows if r.get("link") == EFA and model_of(r) == BENCH_MODEL]
        if efa:
            newest = max(str(r.get("run_id") or "") for r in efa)
            return [r for r in efa if str(r.get("run_id") or "") == newest]
    return []


def efa_verdicts(
    rows: Sequence[Row], loopback: Sequence[Row], target: str = "efa-like TTFT mean <= loopback's worst repeat"
) -> list[Verdict]:
    """efa-like rows against a reference's spread (same front, connector, QPS, prompt length): the loopback
    cpu-vllm run's, or the same run's unshaped step (`in_run_control`). The link adds no artefact when the row's
    TTFT mean is at most the reference repeats' worst."""
    out: list[Verdict] = []
    loop = group(loopback, "router", "connector", "qps", "input_len")
    for (router, conn, qps, n), rs in sorted(group(rows, "router", "connector", "qps", "input_len").items()):
        ref = agg(loop.get((router, conn, qps, n), []), "ttft_ms", "mean")
        point = f"{router}/{conn}, {n} tokens, {qps:g} QPS"
        limit = None if ref is None else ref.hi
        out.append(Verdict(target, point, _med(rs, "ttft_ms", "mean"), None if ref is None else ref.med, limit))
    return out


def in_run_control(efa: Sequence[Row], rows: Sequence[Row]) -> list[Row]:
    """The unshaped rows of the efa rows' own run and model: the same engines, namespaces and TCP transport with no
    rate limit, measured in the same run. Against them the efa check isolates the link's shaping from what
    changes between runs (P's prefill time, the engine set); [] when the run had no unshaped step."""
    if not efa:
        return []
    run_id, model = efa[0].get("run_id"), model_of(efa[0])
    return [r for r in rows if r.get("link") == UNSHAPED and r.get("run_id") == run_id and model_of(r) == model]


def wire_part(wire: Sequence[Row]) -> list[str]:
    """Our connector against bare NIXL, same bytes, same link (suite link-wire): one line per preset."""
    if not wire:
        return [
            "**Not run** (no `link-wire` rows yet: `kvpush bench --suite link-wire`, as root): the wire-speed "
            "target stays unjudged."
        ]
    r0 = wire[0]
    out = [
        f"Run {r0.get('run_id')}: one {r0.get('input_len')}-token prompt's KV "
        f"({int(r0.get('link_prompt_kv_bytes') or 0) / 2**20:.0f} MiB, 64 KiB descriptors) per transfer, one at a "
        f"time after a pause, {len(r0.get('wire_connector_times_ms') or [])} of each: through our connector "
        "(P's xfer-time histogram, one WRITE per prompt through a kvpush push router) and as a bare NIXL WRITE "
        "between two more namespaces on the same link (stack/link/nixl_peer.py). Target (issue 21 item 3): ours "
        "within 10 % or 2 ms of bare NIXL. Reproduce (as root, ~4 min): `kvpush bench --suite link-wire`.",
        "",
        "| preset | tbf (Mbit/s) | wire (ms) | ours median (ms) | bare NIXL median (ms) | ours / bare | target | "
        "P's NIC / KV bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in wire:
        rate, wire_s = _f(r.get("link_rate_bit_s")), _f(r.get("link_expected_transfer_s"))
        verdict = "met" if r.get("wire_ok") else f"**missed** (limit {fmt(_f(r.get('wire_limit_ms')))} ms)"
        out.append(
            f"| {r.get('link')} | {fmt(None if rate is None else rate / 1e6)} "
            f"| {fmt(None if wire_s is None else 1000 * wire_s)} | {fmt(_f(r.get('wire_connector_ms')))} "
            f"| {fmt(_f(r.get('wire_bare_ms')))} | {fmt(_f(r.get('wire_ratio')), 3)} | {verdict} "
            f"| {fmt(bytes_ratio(r), 3)} |"
        )
    return out


def multiturn_part(mt: Sequence[Row], has_plot: bool) -> list[str]:
    if not mt:
        return [
            f"**Multi-turn on {MT_LINK}: not run** (no `multiturn-link` rows yet): the decider's targets "
            "(TTFT p50 turns >= 2 <= 0.5x vllm-router push and <= 0.6x kvpush without the decider) stay unjudged."
        ]
    ok = sum(1 for r in mt if r.get("link_bytes_ok") is True)
    rate = _f(mt[0].get("link_rate_bit_s"))
    out = [
        f"Run {mt[0].get('run_id')}: preset {mt[0].get('link')}, tbf {fmt(None if rate is None else rate / 1e6)} "
        f"Mbit/s; bytes check {ok}/{len(mt)} rows ok; decider options "
        f"{dict((mt[0].get('plan') or {}).get('decider_options') or []) or 'default'}.",
        "",
        *report_multiturn.section(mt, None),
    ]
    if has_plot:
        out += ["", "![multiturn on the link, TTFT by turn](results/multiturn-link-ttft-by-turn.png)"]
    return out


def section(
    rows: Sequence[Row],
    loopback: Sequence[Row],
    mt: Sequence[Row],
    chunk_tokens: int = 256,
    mt_plot: bool = False,
    wire: Sequence[Row] = (),
    earlier: Sequence[Row] = (),
) -> list[str]:
    if not rows:
        return ["(no link run yet: `kvpush bench --suite link`, as root)"]
    out = [
        "Every engine in its own network namespace behind a token-bucket-shaped veth (stack/link); KV over UCX's "
        "TCP transport across it. Pairs: upstream pull, upstream push, ours with two prefills on one decode "
        f"(`kvpush-push`: one-step prefill; `kvpush-progressive`: chunks of {chunk_tokens} tokens), on the "
        "product default: since 2026-12-07 layer-wise push (each layer's blocks written as soon as it is computed, "
        "connector/transfer/layered.py), and a third prefill with the step-wise candidate (`kvpush-step`: one "
        "WRITE at the step's end). Runs before had `kvpush-push` and `kvpush-progressive` step-wise (each chunk's "
        "blocks at its step's end) and a layer-wise prefill (`kvpush-layer`); runs up to 20261207T014140Z also "
        '`kvpush-layer-chunked` (bench/ANALYSIS.md, "Options deleted"). Rows since 20261207T185653Z record the '
        "progress model (`progress`); runs before ran the event-driven progress thread. "
        "The rate is set per step from P's prefill measured in the run (the preset's transfer/prefill share). "
        "`transfer measured` = the connectors' own mean WRITE/READ time (their xfer-time histograms; the wire "
        "time of one prompt is in each step's line); `P's NIC / KV bytes` must be >= 1 (else the KV bypassed the "
        "link and the row fails). Cells: median (min-max) over the repeats; odd repeats take the fronts in "
        "reverse order.",
        "",
    ]
    bad = [r for r in rows if not row_ok(r)]
    out += [
        f"Rows: {len(rows)}, all clean."
        if not bad
        else f"Rows: {len(rows)}, **{len(bad)} not clean** "
        "(a failed request, the bytes check, KV not all by transfer, or outputs unlike one instance).",
        "",
    ]
    for step in steps(rows):
        mine = of_step(rows, step)
        out += [step_header(mine), "", *step_table(mine), ""]
    out += ["### Targets (issue 21)", "", *verdict_table(headline_verdicts(rows)), ""]
    head = [r for r in rows if r.get("headline")]
    for conn, label in OVERLAPS.items():
        for ref in (PULL, UP):
            ratios = paired_ratios(head, conn, ref)
            if ratios:
                out.append(
                    f"Paired within each repeat, {label} / {ref} TTFT mean: median {median(ratios):.2f} "
                    f"(each: {', '.join(f'{x:.2f}' for x in ratios)})."
                )
    loop_id = loopback[0].get("run_id") if loopback else None
    efa_rows = newest_efa(rows, earlier)
    efa_id = efa_rows[0].get("run_id") if efa_rows else None
    control = in_run_control(efa_rows, [*rows, *earlier])
    if control:
        out += [
            "",
            f"efa-like against the unshaped step of the same run ({efa_id}): the same engines, namespaces and TCP "
            "transport with no rate limit, so this check isolates the link's shaping from what changes between runs "
            "(P's prefill time, the engine set). Each row's TTFT mean at most the unshaped repeats' worst at the "
            "same front, connector, QPS and prompt length.",
            "",
            *verdict_table(efa_verdicts(efa_rows, control, "efa-like TTFT mean <= unshaped's worst repeat, same run")),
        ]
    out += [
        "",
        f"efa-like (run {efa_id or '(none)'}) against the loopback cpu-vllm run {loop_id or '(none)'}: each row's "
        "TTFT mean at most the loopback repeats' worst at the same front, connector, QPS and prompt length (the link "
        f"adds no artefact); the bench model only (the loopback run's). Across runs: "
        "a slower P or a larger engine set in the link run reads as the link's cost here"
        + (" (the same-run check above does not)." if control else "."),
        "",
        *verdict_table(efa_verdicts(efa_rows, loopback)),
        "",
    ]
    out += ["### Our connector at wire speed (issue 21 item 3)", "", *wire_part(wire), ""]
    out += [f"### Multi-turn on {MT_LINK}", "", *multiturn_part(mt, mt_plot), ""]
    out += ["### The simulator against the link (issue 21 item 6)", "", *linksim.section(rows, chunk_tokens)]
    return out


def earlier_part(latest_rows: Sequence[Row], earlier: Sequence[Row]) -> list[str]:
    """Steps (prompt length, preset, model) that the latest link run did not measure, each from the newest earlier
    run that did: a one-preset rerun keeps the other presets' tables in the report, each under its own run id."""
    shown = set(steps(latest_rows))
    out: list[str] = []
    latest_id = str(latest_rows[0].get("run_id") or "") if latest_rows else ""
    for run_id in sorted({str(r["run_id"]) for r in earlier if r.get("run_id")}, reverse=True):
        run = [r for r in earlier if str(r.get("run_id")) == run_id]
        for step in steps(run):
            if step in shown:
                continue
            shown.add(step)
            mine = of_step(run, step)
            if run_id < latest_id:
                when = "earlier"
            elif mine and latest_rows and model_of(mine[0]) != model_of(latest_rows[0]):
                when = "later, another model"
            else:
                when = "later, other presets"
            out += [f"Run {run_id} ({when}):", "", step_header(mine), "", *step_table(mine), ""]
    if not out:
        return []
    return ["### Other runs: steps the run above did not measure", "", *out]


def chunk_of(rows: Sequence[Mapping[str, Any]], default: int = 256) -> int:
    for r in rows:
        if (c := r.get("chunk_tokens")) is not None:
            return int(c)
    return default
