"""The seed-sim part of bench/README.md: push vs pull by QPS, or the connectors' WRITE timing (pull + three push
stacks); the profile's a-priori anatomy of one request; the what-if runs; the calibration against the seed's
published rows (calibration.json)."""

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.report.kit import fmt, stat
from loadtest.results import Row
from loadtest.sim import costs
from loadtest.sim.profile import load

STACKS = ("pull", "upstream-push", "kvpush-push", "kvpush-progressive")
WHEN = {
    "upstream-push": "vLLM's NixlPushConnector: WRITE one P step late (next step's metadata, after its forward)",
    "kvpush-push": "ours: WRITE from the end-of-step hook of the step that completes the prompt",
    "kvpush-progressive": "ours, progressive: each chunked-prefill step's blocks written at that step's end",
}


def has_stacks(rows: Sequence[Row]) -> bool:
    return any(r.get("connector") in WHEN for r in rows)


def _stack(r: Row) -> str:
    return "pull" if r["mode"] == "pull" else str(r["connector"])


def connectors_section(rows: Sequence[Row], prefix: str = "seed-sim") -> list[str]:
    by = {(r["qps"], _stack(r)): r for r in rows}
    stacks = [s for s in STACKS if any(_stack(r) == s for r in rows)]
    head = " / ".join(stacks)
    out = [
        f"Simulator profile `{rows[0].get('profile')}`, 1 prefill + 1 decode simulated engine per stack, each behind "
        f"its own kvpush router, {rows[0]['input_len']}-token prompts, {rows[0]['output_len']} output tokens, "
        "Poisson arrivals (the same seed for every stack at a point, order rotated). The push stacks differ only "
        "in when P posts its WRITE:",
        "",
        *[f"- `{s}`: {WHEN[s]}" for s in stacks if s in WHEN],
        "",
        f"Cells: {head}.",
        "",
        "| QPS | n | TTFT mean (ms) | TTFT p50 | TPOT mean | handoff p50 | **ours / upstream TTFT mean** "
        "| progressive / upstream | pull / ours | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for qps in sorted({r["qps"] for r in rows}):
        rs = [by.get((qps, s)) for s in stacks]

        def cells(metric: str, name: str, rs: list[Row | None] = rs) -> str:
            return " / ".join(fmt(stat(r, metric, name)) for r in rs)

        def ratio(a: str, b: str, qps: float = qps) -> str:
            x, y = stat(by.get((qps, a)), "ttft_ms", "mean"), stat(by.get((qps, b)), "ttft_ms", "mean")
            return "-" if x is None or not y else f"{x / y:.2f}"

        n = next((r["n"] for r in rs if r), "-")
        failed = " / ".join(str(r["failed"]) if r else "-" for r in rs)
        out.append(
            f"| {qps} | {n} | {cells('ttft_ms', 'mean')} | {cells('ttft_ms', 'p50')} | {cells('tpot_ms', 'mean')} "
            f"| {cells('handoff_ms', 'p50')} | **{ratio('kvpush-push', 'upstream-push')}** "
            f"| {ratio('kvpush-progressive', 'upstream-push')} | {ratio('pull', 'kvpush-push')} | {failed} |"
        )
    out += [
        "",
        f"![{prefix}](results/{prefix}.png)",
        f"![ttft cdf](results/{prefix}-ttft-cdf.png)",
        f"![handoff cdf](results/{prefix}-handoff-cdf.png)",
    ]
    return out


def mdl_service_s(wait_s: float, rate: float) -> float:
    """M/D/1: the service time whose mean queueing wait at `rate` is `wait_s` (W = r s^2 / (2 (1 - r s)))."""
    if wait_s <= 0 or rate <= 0:
        return 0.0
    a, b, c = rate, 2 * wait_s * rate, -2 * wait_s
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def near_pull(d: dict[str, Any], w: dict[str, Any]) -> float:
    """The scanned pull TTFT at the what-if's P load (without the serial stage)."""
    for x in d.get("scan") or []:
        if abs(float(x["rho"]) - float(w["rho"])) < 1e-9:
            return float(x["pull_ttft_ms"])
    return float("nan")


def calibration_section(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return ["No calibration yet (`python -m loadtest calibrate`, also run by the full seed-sim suite)."]
    d: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    tp, tq = d["target_pull"], d["target_push"]
    pred, apr, pl = d["predicted"], d["apriori_predicted"], d["pull"]
    push = pred["upstream-push"]
    fitted = ", ".join(
        f"`{k}` = {v:.4g} (a-priori {d['apriori'][k]:.4g}{', on a bound of its range' if k in d['bounded'] else ''})"
        for k, v in d["fitted"].items()
    )
    out = [
        f"Fitted on the virtual-time pair (loadtest/sim/pair.py: the simulator's engine, costs and WRITE timing "
        f"without processes), {d['prompt']}-token prompts, {d['output']} output tokens, {d['qps']:g} QPS, "
        f"{d['evaluations']} evaluations ({d.get('refused', 0)} grid points refused because P's prefill alone would "
        f"exceed {100 * d.get('max_rho', 1.0):.0f} % of its time: no steady state, the mean TTFT would grow with the "
        f"run's length). P's utilisation at the fit: {100 * d.get('rho', float('nan')):.0f} %. "
        f"Only the pull row was fitted; FITTED: {fitted}. Profile: "
        "`loadtest/sim/profiles/qwen3-32b-h200-calibrated.yaml` (the a-priori one is unchanged). An `mfu` above 1.0 is "
        "more compute than the H200's BF16 dense peak: the seed's P must have run FP8 or computed fewer prompt "
        "tokens than 16k (prefix hits); with BF16 at mfu <= 1, one P cannot prefill 8 x 16k tokens per second.",
        "",
        "| row | TTFT mean (ms) | TTFT p50 | TPOT mean | handoff p50 | vs seed TTFT | vs seed TPOT |",
        "|---|---|---|---|---|---|---|",
        f"| seed pull (fitted) | {tp['ttft_mean_ms']:.0f} | - | {tp['tpot_mean_ms']:.1f} | - | - | - |",
        f"| model pull, calibrated | {pl['ttft_mean_ms']:.0f} | {pl['ttft_p50_ms']:.0f} "
        f"| {pl['tpot_mean_ms']:.2f} | {pl['handoff_p50_ms']:.0f} "
        f"| {pl['ttft_mean_ms'] / tp['ttft_mean_ms']:.2f}x | {pl['tpot_mean_ms'] / tp['tpot_mean_ms']:.2f}x |",
        f"| seed push (predicted, not fitted) | {tq['ttft_mean_ms']:.0f} | - | {tq['tpot_mean_ms']:.1f} | - | - | - |",
    ]
    for m in ("upstream-push", "kvpush-push", "kvpush-progressive"):
        s = pred[m]
        out.append(
            f"| model {m}, calibrated | {s['ttft_mean_ms']:.0f} | {s['ttft_p50_ms']:.0f} | {s['tpot_mean_ms']:.2f} "
            f"| {s['handoff_p50_ms']:.0f} | {s['ttft_mean_ms'] / tq['ttft_mean_ms']:.2f}x "
            f"| {s['tpot_mean_ms'] / tq['tpot_mean_ms']:.2f}x |"
        )
    for m in ("pull", "upstream-push", "kvpush-push", "kvpush-progressive"):
        s = apr[m]
        out.append(
            f"| model {m}, a-priori | {s['ttft_mean_ms']:.0f} | {s['ttft_p50_ms']:.0f} | {s['tpot_mean_ms']:.2f} "
            f"| {s['handoff_p50_ms']:.0f} | - | - |"
        )
    if d.get("scan"):
        out += [
            "",
            "P's load scanned (mfu set so that P's prefill alone takes the given share of its time; the fitted setup "
            "cost kept): pull and upstream push TTFT mean (ms) and their ratio. The seed's ratio is "
            f"{tp['ttft_mean_ms'] / tq['ttft_mean_ms']:.1f}x.",
            "",
            "| P utilisation | mfu | pull TTFT | push TTFT | pull / push | pull TPOT | push TPOT |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in d["scan"]:
            out.append(
                f"| {100 * x['rho']:.1f} % | {x['mfu']:.3f} | {x['pull_ttft_ms']:.0f} | {x['push_ttft_ms']:.0f} "
                f"| {x['pull_ttft_ms'] / x['push_ttft_ms']:.2f} | {x['pull_tpot_ms']:.2f} | {x['push_tpot_ms']:.2f} |"
            )
    seed_gap = tp["ttft_mean_ms"] - tq["ttft_mean_ms"]
    model_gap = d["pull"]["ttft_mean_ms"] - push["ttft_mean_ms"]
    missing_s = (seed_gap - model_gap) / 1000
    service = mdl_service_s(missing_s, float(d["qps"]))
    out += [
        "",
        f"Upstream push predicted {push['ttft_mean_ms']:.0f} ms TTFT mean vs the seed's {tq['ttft_mean_ms']:.0f} ms "
        f"({push['ttft_mean_ms'] / tq['ttft_mean_ms']:.2f}x), TPOT {push['tpot_mean_ms']:.2f} vs "
        f"{tq['tpot_mean_ms']:.1f} ms ({push['tpot_mean_ms'] / tq['tpot_mean_ms']:.2f}x).",
    ]
    near = min(d.get("scan") or [{}], key=lambda x: abs(math.log(x.get("push_ttft_ms", 1.0) / tq["ttft_mean_ms"])))
    if near:
        out += [
            "",
            f"Nearest the seed's push row in the scan: P at {100 * near['rho']:.0f} % (mfu {near['mfu']:.2f}) gives "
            f"upstream push {near['push_ttft_ms']:.0f} ms / {near['push_tpot_ms']:.2f} ms "
            f"(seed {tq['ttft_mean_ms']:.0f} / {tq['tpot_mean_ms']:.1f}), "
            f"but pull {near['pull_ttft_ms']:.0f} ms (seed {tp['ttft_mean_ms']:.0f}): "
            "the model's push row can match the seed's, its pull row then cannot.",
        ]
    if abs(push["ttft_mean_ms"] / tq["ttft_mean_ms"] - 1) > 0.25:
        out += [
            "",
            f"**The model cannot reproduce both rows.** The seed's pull-push TTFT gap is {seed_gap:.0f} ms; the "
            f"calibrated model's is {model_gap:.0f} ms. In the model, pull pays only D's API time, descriptor setup "
            "on D's engine loop (which also raises TPOT, so the TPOT target caps it) and one step boundary; push "
            "shares P's queue with pull. The mechanism it lacks is a **pull-only, load-dependent wait that does "
            f"not slow D's decode steps**, about {missing_s * 1000:.0f} ms per request at {d['qps']:g} QPS (an "
            f"M/D/1 queue with Poisson input would need ~{service * 1000:.0f} ms of serial service per request; "
            "the what-if below shows that P's smoothed output makes a plain serial stage queue far less).",
        ]
    w = d.get("what_if_mechanism")
    if w:
        worst = max(abs(w["pull_ttft_ms"] / tp["ttft_mean_ms"] - 1), abs(w["push_ttft_ms"] / tq["ttft_mean_ms"] - 1))
        out += [
            "",
            f"What-if check of that mechanism (not part of any profile): at P {100 * w['rho']:.0f} % busy (push "
            f"{w['push_ttft_ms']:.0f} ms), a pull-only serial stage on D before each READ of "
            f"{1000 * w['pull_serial_s']:.0f} ms per 16k request brings the model's pull to "
            f"{w['pull_ttft_ms']:.0f} ms TTFT / {w['pull_tpot_ms']:.2f} ms TPOT (seed {tp['ttft_mean_ms']:.0f} / "
            f"{tp['tpot_mean_ms']:.1f}), both rows within {100 * worst:.0f} % on TTFT: a serial stage at its own "
            f"saturation (1/QPS = {1000 / float(d['qps']):.0f} ms per request) adds only "
            f"{w['pull_ttft_ms'] - near_pull(d, w):.0f} ms. So the seed's pull wait needs more than one serial stage: "
            "e.g. READs of 16k prompts that each take longer than 1/QPS with only a few in flight, or D admitting "
            "remote-KV requests in bursts. Measuring vLLM's pull path on a GPU pair for such a wait is the next "
            "step; the simulator does not model it.",
        ]
    return out


PUBLISHED = (
    "Published (Qwen3-32B, 1P+1D H200-class, 3.2 Tbps, 8 req/s, 16k prompts): TTFT pull ~1744 ms vs push "
    "~540 ms (3.2x); TPOT ~10.4 ms (pull) vs ~7 ms (push); about equal at low load."
)


def _g(row: Row | None, metric: str, stat: str) -> float | None:
    if row is None or not row.get(metric):
        return None
    v = row[metric].get(stat)
    return None if v is None else float(v)


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def anatomy(profile: str, prompt: int, qps: Sequence[float]) -> list[str]:
    """The profile's own numbers for one request: what each mode pays, and the load pull's setup puts on D."""
    try:
        p = load(profile)
    except (OSError, ValueError, KeyError):
        return [f"(profile {profile!r} not found: no anatomy)"]
    if costs.prefill_time(p, prompt) <= 0 or not qps:
        return []
    prefill, setup = costs.prefill_time(p, prompt), costs.setup_time(p, prompt)
    xfer, api = costs.transfer_time(p, prompt), costs.api_time(p, prompt)
    step = costs.step_time(p, [], [prompt])
    loads = ", ".join(f"{q:g} req/s: {100 * q * setup:.0f} %" for q in qps)
    per_desc_to_fill = (
        1 / (max(qps) * costs.descriptors(p, prompt)) * 1e6 if qps and costs.descriptors(p, prompt) else 0
    )
    return [
        f"A-priori anatomy of one {prompt}-token request (profile `{profile}`, no queueing): prefill "
        f"{1000 * prefill:.0f} ms (so P saturates near {1 / prefill:.2f} req/s), API parse+tokenize "
        f"{1000 * api:.0f} ms, {costs.descriptors(p, prompt):,} descriptors per rank, descriptor setup "
        f"{1000 * setup:.0f} ms, transfer {1000 * xfer:.0f} ms ({costs.kv_bytes(p, prompt) / 2**30:.1f} GiB), "
        f"first decode step {1000 * step:.1f} ms. Both modes set up and move the KV after P's prefill; push does "
        "the setup on P's writer thread and has D's API work done while P prefills, pull pays D's API work and "
        "the setup on D's engine loop (stalling every running decode) in series, plus a step boundary. "
        f"Share of D's loop taken by pull's setup: {loads}. For pull's setup alone to saturate D at "
        f"{max(qps):g} req/s it would have to cost {per_desc_to_fill:.2f} us per descriptor "
        f"(profile: {1e6 * p.setup_per_descriptor_s:.2f} us).",
    ]


def seed_section(rows: Sequence[Row], prefix: str = "seed-sim") -> list[str]:
    if not rows:
        return ["No seed-sim run yet."]
    if has_stacks(rows):
        qps = sorted({float(r["qps"]) for r in rows if r.get("qps")})
        return [
            *connectors_section(rows, prefix),
            "",
            *anatomy(str(rows[0].get("profile")), int(rows[0]["input_len"]), qps),
            "",
            PUBLISHED,
        ]
    by = {(r["qps"], r["mode"]): r for r in rows}
    out = [
        f"Simulator profile `{rows[0].get('profile')}` (a-priori numbers and their sources: "
        "`loadtest/sim/profiles/qwen3-32b-h200.yaml`), 1 prefill + 1 decode simulated engine, our router in each mode, "
        f"{rows[0]['input_len']}-token prompts, {rows[0]['output_len']} output tokens, Poisson arrivals (same seed "
        "for both modes at a point). Ratios are pull / push: above 1 means push is better.",
        "",
        "| QPS | n | TTFT mean push / pull (ms) | TTFT p50 push / pull | TTFT p99 push / pull | TPOT mean push / pull "
        "| handoff p50 push / pull | **pull/push TTFT mean** | p50 | p99 | TPOT mean | failed push / pull |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for qps in sorted({r["qps"] for r in rows}):
        pu, pl = by.get((qps, "push")), by.get((qps, "pull"))

        def pair(metric: str, stat: str, pu: Row | None = pu, pl: Row | None = pl) -> str:
            return f"{_f(_g(pu, metric, stat))} / {_f(_g(pl, metric, stat))}"

        def rat(metric: str, stat: str, pu: Row | None = pu, pl: Row | None = pl) -> str:
            return _ratio(_g(pl, metric, stat), _g(pu, metric, stat))

        n = pu["n"] if pu else (pl["n"] if pl else "-")
        failed = f"{pu['failed'] if pu else '-'} / {pl['failed'] if pl else '-'}"
        out.append(
            f"| {qps} | {n} | {pair('ttft_ms', 'mean')} | {pair('ttft_ms', 'p50')} | {pair('ttft_ms', 'p99')} "
            f"| {pair('tpot_ms', 'mean')} | {pair('handoff_ms', 'p50')} | **{rat('ttft_ms', 'mean')}** "
            f"| {rat('ttft_ms', 'p50')} | {rat('ttft_ms', 'p99')} | {rat('tpot_ms', 'mean')} "
            f"| {failed} |"
        )
    qps = sorted(float(r["qps"]) for r in rows if r.get("qps"))
    ratios = {
        q: _ratio(_g(by.get((q, "pull")), "ttft_ms", "mean"), _g(by.get((q, "push")), "ttft_ms", "mean"))
        for q in sorted(set(qps))
    }
    out += [
        "",
        "**Headline** (pull / push TTFT mean, by QPS): "
        + ", ".join(f"{q:g}: {v}" for q, v in ratios.items())
        + ". Published: 3.2 at 8 req/s. Run-to-run noise at a point is several percent (shared CPUs).",
    ]
    out += ["", *anatomy(str(rows[0].get("profile")), int(rows[0]["input_len"]), sorted(set(qps)))]
    out += [
        "",
        PUBLISHED,
        "",
        f"![{prefix}](results/{prefix}.png)",
        f"![ttft cdf](results/{prefix}-ttft-cdf.png)",
        f"![handoff cdf](results/{prefix}-handoff-cdf.png)",
    ]
    return out


def what_if_section(rows: Sequence[Row]) -> list[str]:
    if not rows:
        return []
    return [
        f"### What-if (not a-priori): profile `{rows[0].get('profile')}`",
        "",
        "A sensitivity probe, not a prediction: the profile's header says which numbers were changed from the "
        "a-priori one and why. It shows what would have to be true for push to win big, not that it does.",
        "",
        *seed_section(rows, prefix="seed-sim-whatif"),
        "",
    ]
