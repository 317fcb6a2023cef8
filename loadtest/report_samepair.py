"""The same-pair part of bench/README.md: kvpush and vllm-router loaded at once on one push pair (issue 9)."""

from collections.abc import Sequence

from loadtest.report_cpu import issue9_verdicts, paired_lines
from loadtest.reportkit import Agg, Row, agg, agg_of, group, verdict_table


def _cell(a: Agg | None, digits: int = 1) -> str:
    return "-" if a is None else a.text(digits)


def _ext(r: Row) -> float | None:
    v = r.get("kv_external_frac")
    return None if v is None else 100 * float(v)


def table(rows: Sequence[Row]) -> list[str]:
    out = [
        "| pair QPS | connector | front | repeats | n | failed | TTFT p50 | TTFT mean | TPOT mean | handoff p50 "
        "| req/s (this front) | KV ext % (pair) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (qps, conn, router), rs in sorted(group(rows, "qps", "connector", "router").items(), key=lambda kv: kv[0]):
        out.append(
            f"| {qps} | {conn} | {router} | {len(rs)} | {sum(int(r['n']) for r in rs)} "
            f"| {sum(int(r['failed']) for r in rs)} | {_cell(agg(rs, 'ttft_ms', 'p50'))} "
            f"| {_cell(agg(rs, 'ttft_ms', 'mean'))} | {_cell(agg(rs, 'tpot_ms', 'mean'))} "
            f"| {_cell(agg(rs, 'handoff_ms', 'p50'))} | {_cell(agg(rs, 'req_per_s', ''), 2)} "
            f"| {_cell(agg_of(rs, _ext), 0)} |"
        )
    return out


def section(rows: Sequence[Row]) -> list[str]:
    if not rows:
        return ["No same-pair run yet."]
    reps = max(int(r.get("repeat", 0)) for r in rows) + 1
    return [
        f"kvpush and vllm-router 0.1.17 (push mode) loaded **at the same time** in front of one real vLLM push pair "
        f"(model size `{rows[0].get('model')}`, P on core 0, D on core 1): each front sends half the point's rate "
        "on its own Poisson arrivals and its own prompts, so the pair carries the point's rate and both fronts "
        "meet the same engines at the same moments; the drift that decides cpu-vllm's back-to-back comparison "
        f"hits both alike. {rows[0]['input_len']}-token prompts, {rows[0]['output_len']} output tokens, {reps} "
        f"repeat{'s' if reps != 1 else ''} per point; cells are the median over the repeats with (min-max). "
        "`KV ext` = the decode's prompt tokens that arrived by KV transfer, over both fronts' requests.",
        "",
        *table(rows),
        "",
        "### Issue 9 target: kvpush vs vllm-router on the same push pair, at once (medians of repeats)",
        "",
        *verdict_table(issue9_verdicts(rows)),
        "",
        *[line for text in paired_lines(rows, "At once, per repeat") for line in (text, "")],
        "![same-pair](results/same-pair.png)",
        "![ttft cdf](results/same-pair-ttft-cdf.png)",
    ]
