"""The same-pair part of bench/README.md: kvpush and vllm-router loaded at once on one push pair (issue 9)."""

from collections.abc import Sequence

from loadtest.report.cpu import paired_lines as repeat_lines
from loadtest.report.cpu import router_verdicts
from loadtest.report.kit import agg, agg_of, cell, group, kv_ext_pct, verdict_table
from loadtest.results import Row


def table(rows: Sequence[Row]) -> list[str]:
    out = [
        "| pair QPS | connector | front | repeats | n | failed | TTFT p50 | TTFT mean | TPOT mean | handoff p50 "
        "| req/s (this front) | KV ext % (pair) | paired TTFT diff p50 (ms) | faster in |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (qps, conn, router), rs in sorted(group(rows, "qps", "connector", "router").items(), key=lambda kv: kv[0]):
        out.append(
            f"| {qps} | {conn} | {router} | {len(rs)} | {sum(int(r['n']) for r in rs)} "
            f"| {sum(int(r['failed']) for r in rs)} | {cell(agg(rs, 'ttft_ms', 'p50'))} "
            f"| {cell(agg(rs, 'ttft_ms', 'mean'))} | {cell(agg(rs, 'tpot_ms', 'mean'))} "
            f"| {cell(agg(rs, 'handoff_ms', 'p50'))} | {cell(agg(rs, 'req_per_s', ''), 2)} "
            f"| {cell(agg_of(rs, kv_ext_pct), 0)} | {_paired_cells(rs)} |"
        )
    return out


def _diff(r: Row) -> float | None:
    paired = r.get("paired_ttft")
    return None if not paired else float(paired["diff_p50_ms"])


def _paired_cells(rows: Sequence[Row]) -> str:
    """Median (min-max) over the repeats of the paired TTFT difference, and the faster share of all pairs."""
    found = [r["paired_ttft"] for r in rows if r.get("paired_ttft")]
    if not found:
        return "- | -"
    pairs = sum(float(p["pairs"]) for p in found)
    faster = sum(float(p["faster_share"]) * float(p["pairs"]) for p in found)
    return f"{cell(agg_of(rows, _diff), 1)} | {faster:.0f} of {pairs:.0f} ({100 * faster / pairs:.0f} %)"


def paired_lines(rows: Sequence[Row]) -> list[str]:
    """kvpush against vllm-router pair by pair, per point: the verdict the drift cannot decide."""
    out = []
    by = group([r for r in rows if r.get("router") == "kvpush"], "connector")
    for (conn,), rs in sorted(by.items()):
        points = group(rs, "qps")
        cells = [
            f"{qps:g} QPS {_paired_cells(points[(qps,)]).replace(' | ', ' ms, kvpush faster in ')}"
            for (qps,) in sorted(points)
            if any(r.get("paired_ttft") for r in points[(qps,)])
        ]
        if cells:
            out.append(f"Paired by arrival on the {conn} pair (kvpush minus vllm-router): " + "; ".join(cells) + ".")
    return out


def section(rows: Sequence[Row]) -> list[str]:
    if not rows:
        return ["No same-pair run yet."]
    reps = max(int(r.get("repeat", 0)) for r in rows) + 1
    return [
        f"kvpush and vllm-router 0.1.17 (push mode) loaded **at the same time** in front of one real vLLM push pair "
        f"(model size `{rows[0].get('model')}`, P on core 0, D on core 1). The fronts take one Poisson stream at "
        "the point's rate in turn (in each block of two consecutive arrivals a coin decides which front sends "
        "which), each with its own prompts: the pair carries the point's rate, both fronts meet the same engines "
        "at the same moments, and the drift that decides cpu-vllm's back-to-back comparison hits both alike. "
        "`paired` = request j of one front against request j of the other (the same block of arrivals): on each "
        "row, the median of this front's TTFT minus the other's over the pairs, and in how many this one was "
        "faster. "
        f"{rows[0]['input_len']}-token prompts, {rows[0]['output_len']} output tokens, {reps} "
        f"repeat{'s' if reps != 1 else ''} per point; cells are the median over the repeats with (min-max). "
        "`KV ext` = the decode's prompt tokens that arrived by KV transfer, over both fronts' requests.",
        "",
        *table(rows),
        "",
        "### Issue 9 target: kvpush vs vllm-router on the same push pair, at once (medians of repeats)",
        "",
        *verdict_table(router_verdicts(rows)),
        "",
        *[line for text in paired_lines(rows) for line in (text, "")],
        *[line for text in repeat_lines(rows, "At once, per repeat") for line in (text, "")],
        "![same-pair](results/same-pair.png)",
        "![ttft cdf](results/same-pair-ttft-cdf.png)",
    ]
