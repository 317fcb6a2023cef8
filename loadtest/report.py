"""bench/README.md, generated from the latest run of each suite in bench/results/summary.json."""

import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import report_cpu, report_overhead, report_samepair, report_sim
from loadtest.sim import costs
from loadtest.sim.profile import load

Row = dict[str, Any]
PUBLISHED = (
    "Published (Qwen3-32B, 1P+1D H200-class, 3.2 Tbps, 8 req/s, 16k prompts): TTFT pull ~1744 ms vs push "
    "~540 ms (3.2x); TPOT ~10.4 ms (pull) vs ~7 ms (push); about equal at low load."
)


A_PRIORI = "qwen3-32b-h200"  # the seed-sim headline profile; runs on any other profile are what-ifs


def _what_if(row: Row) -> bool:
    return row.get("suite") == "seed-sim" and row.get("profile") not in (None, A_PRIORI)


def latest(rows: Sequence[Row], suite: str) -> list[Row]:
    """Rows of the newest run_id of a suite (run ids are UTC stamps, so they sort by time); what-ifs and
    profiling runs (overhead with cprofile: the profiled router is slowed) excluded."""
    mine = [
        r
        for r in rows
        if r.get("suite") == suite and r.get("run_id") and not _what_if(r) and not r.get("profiling_run")
    ]
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


def _g(row: Row | None, metric: str, stat: str) -> float | None:
    if row is None or not row.get(metric):
        return None
    v = row[metric].get(stat)
    return None if v is None else float(v)


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    return f"{cpu}, {os.cpu_count()} cores, {mem_kb / 2**20:.0f} GiB RAM, {platform.system()} {platform.release()}"


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
    if report_sim.has_stacks(rows):
        qps = sorted({float(r["qps"]) for r in rows if r.get("qps")})
        return [
            *report_sim.connectors_section(rows, prefix),
            "",
            *anatomy(str(rows[0].get("profile")), int(rows[0]["input_len"]), qps),
            "",
            PUBLISHED,
        ]
    by = {(r["qps"], r["mode"]): r for r in rows}
    out = [
        f"Simulator profile `{rows[0].get('profile')}` (a-priori numbers and their sources: "
        "`loadtest/profiles/qwen3-32b-h200.yaml`), 1 prefill + 1 decode simulated engine, our router in each mode, "
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


def render(rows: Sequence[Row], results_dir: Path | None = None) -> str:
    seed, cpu, over = latest(rows, "seed-sim"), latest(rows, "cpu-vllm"), latest(rows, "overhead")
    same = latest(rows, "same-pair")
    commits = sorted(
        {
            str(r.get("git_commit"))[:7] + ("-dirty" if "dirty" in str(r.get("git_commit")) else "")
            for r in (*seed, *cpu, *same, *over)
        }
    )
    lines = [
        "# kvpush benchmarks",
        "",
        "Generated by `python -m loadtest bench` (`make bench`) from `bench/results/summary.json`; "
        "do not edit by hand. What the latest figures mean, the targets they miss and why (written by hand, "
        "dated): [ANALYSIS.md](ANALYSIS.md).",
        f"Latest runs: seed-sim {seed[0]['run_id'] if seed else '-'}, cpu-vllm {cpu[0]['run_id'] if cpu else '-'}, "
        f"same-pair {same[0]['run_id'] if same else '-'}, overhead {over[0]['run_id'] if over else '-'}; "
        f"commits {', '.join(commits) or '-'}.",
        "",
        f"Machine: {machine()}. Load generator, router(s) and workers share these cores (and, on the dev box, "
        "other work), so small differences are noise: about +-10 % per point on real vLLM (anchors.md).",
        "",
        "Metrics follow `vllm bench serve`: TTFT = first streamed chunk with a choice; TPOT = (E2E - TTFT) / "
        "(output tokens - 1) per request, tokens from usage; ITL per chunk; failures counted, never dropped. "
        "`handoff` is measured by our router per request: prefill leg done -> decode's first byte.",
        "",
        "## seed-sim: push vs pull on the simulator",
        "",
        *seed_section(seed),
        "",
        "### Calibration against the seed (issue 8 item 7)",
        "",
        *report_sim.calibration_section(None if results_dir is None else results_dir / "calibration.json"),
        "",
        *what_if_section(latest_what_if(rows)),
        "## cpu-vllm: real vLLM CPU engines",
        "",
        *report_cpu.cpu_section(cpu),
        "",
        "## same-pair: kvpush and vllm-router at once on one real push pair",
        "",
        *report_samepair.section(same),
        "",
        "## overhead: the front door itself",
        "",
        *report_overhead.overhead_section(over, results_dir),
        "",
        *extra_sections(rows, results_dir),
        *REPRODUCE,
    ]
    return "\n".join(lines)


REPRODUCE = [
    "## Reproduce",
    "",
    "Each command appends rows to bench/results/summary.json and regenerates this file; wrap runs that start "
    "engines in `flock /tmp/kvpush-vllm.lock nice -n 10 ...` on a shared box. Sizes are `--set FIELD=VALUE` "
    "fields of the suite's plan (loadtest/README.md).",
    "",
    "```",
    "kvpush bench --suite cpu-vllm --set qps=1,3,4.5,6,8 --set requests=30 --set max_point_s=30 --set repeats=2",
    "kvpush bench --suite same-pair                     # both push pairs, 5 points x 3 repeats, fronts at once",
    "kvpush bench --suite overhead                      # 3 repeats of 1/64/256 concurrency, 5 fronts",
    "kvpush bench --suite overhead --set cprofile=true --set repeats=1 --set levels=1:300,64:1500   # profile",
    "kvpush bench --suite seed-sim                      # 4 stacks + calibration",
    "python -m loadtest calibrate                       # calibration alone (virtual time, minutes)",
    "```",
]


def extra_sections(rows: Sequence[Row], results_dir: Path | None) -> list[str]:
    """Suites that render their own section: a module-level `section(rows, results_dir) -> list[str]`
    (multiturn; see loadtest/README.md), given the latest run's rows. Missing modules are skipped."""
    from loadtest.bench.run import suite_module

    out: list[str] = []
    for name in ("multiturn",):
        mine = latest(rows, name)
        module = suite_module(name)
        if not mine or module is None or not hasattr(module, "section"):
            continue
        out += [f"## {name}", "", *module.section(mine, results_dir), ""]
    return out
