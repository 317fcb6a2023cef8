"""Suite "multiturn": multi-turn chat sessions on real vLLM CPU engines (one prefill, two decodes, prefix caching
on), through three fronts in turn with the same sessions and arrival times:

- kvpush with the session-affinity decider (push; short uncached suffixes bypass prefill on the decode that holds
  the conversation);
- kvpush without a decider (push, every turn prefilled and transferred whole);
- vllm-router 0.1.17 in push mode (it detects push from prefill's `transfer_mode`) with `consistent_hash` on
  X-Session-ID for decode (when its binary is installed: `make bench` puts it in .venv-vrouter).

P runs on core 0, both decodes share core 1. Every engine reports cached tokens per request
(--enable-prompt-tokens-details) and runs with VLLM_SERVER_DEV_MODE=1, so the prefix caches are reset
(POST /reset_prefix_cache) before each front: no front profits from an earlier front's turns. One row per front:
TTFT per turn index, TTFT over turns >= 2, TPOT, decode's prompt tokens by source (both decodes summed), the
share of an ideal router's reusable tokens that were local cache hits on decode, how many answers equal the
first front's (greedy: all must) and, for a kvpush front, the decider's bypass predictions within 20 % of the
actual uncached tokens (its router's kvpush_bypass_accurate / kvpush_bypass_checked counters at the end of the
run; issue 11's target: >= 90 % of bypass decisions). A PNG of TTFT p50 by turn goes next to summary.json.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest import multiturn, promtext
from loadtest.benchkit import kv_sources, scrape, url, vllm_lock, vrouter_binary
from loadtest.job import REPO
from loadtest.records import write_jsonl
from loadtest.results import RowLabels, append_rows, build_row, git_commit
from loadtest.stats import summarize
from stack.engines import Engine, Fleet
from stack.family import PdFamily, pd_family, start_family
from stack.local import StackOptions, ensure_model
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, router_spec

DETAILS = "--enable-prompt-tokens-details"
CONNECTORS = {"upstream-push": ("NixlPushConnector", None), "kvpush-push": ("KvpushConnector", "connector.plugin")}
FRONTS = ("kvpush", "kvpush-decider", "vllm-router")  # the first one is the answers' reference
ACCURACY_TARGET = 0.9  # issue 11: >= 90 % of bypass decisions predicted within 20 % of the actual uncached tokens


@dataclass(frozen=True)
class MultiTurnPlan:
    sessions: int
    session_rate: float  # sessions started per second (Poisson)
    turns_min: int = 6
    turns_max: int = 10
    message_min: int = 50  # tokens of each turn's new message
    message_max: int = 500
    answer_min: int = 32
    answer_max: int = 128
    think_s: float = 2.0  # mean think time between turns (exponential)
    system_tokens: int = 0
    seed: int = 11
    connector: str = "upstream-push"  # or "kvpush-push" (our connector on the three engines)
    model_size: str = "bench"
    max_model_len: int = 8192  # ten turns of up to 500 + 128 tokens
    decider_options: tuple[tuple[str, float], ...] = ()  # e.g. (("bypass_max_uncached_tokens", 256),)
    vrouter_decode_policy: str = "consistent_hash"
    timeout_s: float = 300.0

    def shape(self) -> multiturn.SessionShape:
        return multiturn.SessionShape(
            sessions=self.sessions,
            session_rate=self.session_rate,
            turns=(self.turns_min, self.turns_max),
            message_tokens=(self.message_min, self.message_max),
            answer_tokens=(self.answer_min, self.answer_max),
            think_s=self.think_s,
            system_tokens=self.system_tokens,
            seed=self.seed,
        )


FULL = MultiTurnPlan(sessions=24, session_rate=0.2)
SMOKE = MultiTurnPlan(
    sessions=2,
    session_rate=1.0,
    turns_min=2,
    turns_max=3,
    message_min=40,
    message_max=120,
    answer_min=8,
    answer_max=16,
    think_s=0.2,
    model_size="tiny",
    max_model_len=2048,
    timeout_s=120.0,
)


def engine_family(plan: MultiTurnPlan, model: Path) -> PdFamily:
    """mt-p0 on core 0, mt-d0 and mt-d1 sharing core 1, all on the plan's connector."""
    connector, module = CONNECTORS[plan.connector]
    return pd_family(
        "mt", model, connector, module=module, n_decode=2, extra_args=(DETAILS,), max_model_len=plan.max_model_len
    )


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def decider_yaml(plan: MultiTurnPlan, block_tokens: int | None = None) -> str:
    """The router's decider block; the engines' block size unless the plan sets one."""
    options = dict(plan.decider_options)
    if block_tokens is not None:
        options.setdefault("block_tokens", block_tokens)
    lines = ["decider:", "  name: session-affinity"] + [f"  {k}: {v:g}" for k, v in options.items()]
    return "\n".join(lines) + "\n"


def block_size(engine_url: str) -> int | None:
    """The engine's KV block size, from its vllm:cache_config_info labels."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'block_size="' in line:
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    return None


def kvpush_proc(
    name: str, port: int, prefill: str, decodes: list[str], logs: Path, config: Path | None
) -> ManagedProcess:
    spec = router_spec(port, "push", [prefill], decodes, "--log-level", "warning", name=name, config=config)
    return Router(spec, log_dir=logs)


def vrouter_push_proc(
    plan: MultiTurnPlan, port: int, prom: int, prefill: str, decodes: list[str], logs: Path, binary: str
) -> ManagedProcess:
    argv = [binary, "--vllm-pd-disaggregation", "--prefill", prefill]
    for d in decodes:
        argv += ["--decode", d]
    argv += ["--kv-connector", "nixl", "--host", LOOPBACK, "--port", str(port)]
    argv += ["--prefill-policy", "round_robin", "--decode-policy", plan.vrouter_decode_policy]
    argv += ["--worker-startup-check-interval", "1", "--prometheus-port", str(prom), "--log-level", "warning"]
    return ManagedProcess(
        ProcessSpec("vllm-router-mt", tuple(argv), _env(), logs / "vllm-router-mt.log", f"{url(port)}/health", REPO)
    )


def words_per_token(prefill_url: str) -> float:
    """Measured on the engine's own tokenizer: words of message_text per token."""
    sample = multiturn.message_text(400, "user", 1, 1.0)
    resp = httpx.post(
        f"{prefill_url}/tokenize", json={"model": "tiny", "prompt": sample, "add_special_tokens": False}, timeout=30
    )
    resp.raise_for_status()
    return len(sample.split()) / max(1, len(resp.json()["tokens"]))


def reset_caches(engines: list[Engine]) -> None:
    for engine in engines:
        httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30).raise_for_status()


def decode_sources(decodes: list[Engine]) -> dict[str, float]:
    total: dict[str, float] = {}
    for engine in decodes:
        for k, v in kv_sources({}, scrape(engine.url)).items():
            total[k] = total.get(k, 0.0) + v
    return total


def _start_front(
    front: str, plan: MultiTurnPlan, fleet: Fleet, p: Engine, decodes: list[str], logs: Path, run_dir: Path
) -> str | None:
    prefill = p.engine_spec.prefill_arg()
    port = free_port()
    if front == "vllm-router":
        binary = vrouter_binary()
        if binary is None:
            print("multiturn: vllm-router not found (.venv-vrouter, `make bench` installs it); its row is skipped")
            return None
        proc = fleet.start(vrouter_push_proc(plan, port, free_port(), p.url, decodes, logs, binary))
        proc.wait_healthy(timeout=120.0)
        return url(port)
    config = None
    if front == "kvpush-decider":
        config = run_dir / "multiturn-decider.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(decider_yaml(plan, block_size(p.url)), encoding="utf-8")
    proc = fleet.start(kvpush_proc(f"router-mt-{front}", port, prefill, decodes, logs, config))
    proc.wait_healthy(timeout=60.0)
    return url(port)


def run(plan: MultiTurnPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=plan.model_size))
    sessions = multiturn.plan_sessions(plan.shape())
    rows: list[dict[str, Any]] = []
    baseline: list[multiturn.TurnRecord] | None = None
    with vllm_lock(), Fleet(logs, base_env=_env() | {"VLLM_SERVER_DEV_MODE": "1"}) as fleet:
        family = start_family(fleet, engine_family(plan, model), timeout=600.0)
        engines, p, decodes = list(family.members), family.prefills[0], list(family.decodes)
        ratio = words_per_token(p.url)
        for front in FRONTS:
            base = _start_front(front, plan, fleet, p, [d.url for d in decodes], logs, run_dir)
            if base is None:
                continue
            reset_caches(engines)
            before = decode_sources(decodes)
            target = multiturn.Target(base, "tiny", ratio, plan.timeout_s)
            turns, duration = asyncio.run(multiturn.run_sessions(target, sessions))
            after = decode_sources(decodes)
            if progress:
                print(f"multiturn {front}: {sum(t.rec.ok for t in turns)}/{len(turns)} turns ok in {duration:.1f} s")
            multiturn.write_turns(run_dir / f"multiturn-{front}" / "turns.jsonl", turns)
            write_jsonl(run_dir / f"multiturn-{front}" / "requests.jsonl", [t.rec for t in turns])
            baseline = baseline if baseline is not None else turns
            row = _row(plan, front, turns, duration, before, after, baseline, run_id, run_dir)
            row["routes"] = None if front == "vllm-router" else routes(base)
            row["bypass_accuracy"] = None if front == "vllm-router" else scrape_bypass_accuracy(base)
            rows.append(row)
    append_rows(summary, rows)
    plot_ttft_by_turn(rows, summary.parent / "multiturn-ttft-by-turn.png")
    return rows


def routes(router_url: str) -> dict[str, int]:
    """How the kvpush router served the run's requests (its /debug/timings records by mode: push, bypass, ...)."""
    try:
        records = httpx.get(f"{router_url}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no route counts from {router_url}: {error}")
        return {}
    out: dict[str, int] = {}
    for record in records:
        out[str(record.get("mode"))] = out.get(str(record.get("mode")), 0) + 1
    return out


def scrape_bypass_accuracy(router_url: str) -> dict[str, int] | None:
    """The kvpush router's bypass-prediction counters now (its /metrics); None when it has none or is gone."""
    try:
        return bypass_accuracy(scrape(router_url))
    except httpx.HTTPError as error:
        print(f"multiturn: no bypass accuracy from {router_url}: {error}")
        return None


def bypass_accuracy(samples: Mapping[promtext.Sample, float]) -> dict[str, int] | None:
    """{"checked", "accurate"} from kvpush_bypass_checked / kvpush_bypass_accurate (counters: exported with a
    `_total` suffix); None when the router exports neither (it runs no decider)."""
    names = {name for name, _ in samples}
    counts: dict[str, int] = {}
    for key in ("checked", "accurate"):
        found = [n for n in (f"kvpush_bypass_{key}_total", f"kvpush_bypass_{key}") if n in names]
        if not found:
            return None
        counts[key] = int(promtext.total(samples, found[0]))
    return counts


def _row(
    plan: MultiTurnPlan,
    front: str,
    turns: list[multiturn.TurnRecord],
    duration: float,
    before: dict[str, float],
    after: dict[str, float],
    baseline: list[multiturn.TurnRecord],
    run_id: str,
    run_dir: Path,
) -> dict[str, Any]:
    figures = multiturn.by_turn(turns)
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    ideal = figures["ideal_reusable_tokens"]
    equal, compared = multiturn.answers_agree(turns, baseline)
    extra: dict[str, Any] = {
        "run_id": run_id,
        "front": front,
        "decider": "session-affinity" if front == "kvpush-decider" else None,
        "model": plan.model_size,
        "plan": asdict(plan),
        "decode_prompt_tokens_by_source": sources,
        "local_hit_frac_of_ideal": sources.get("local_cache_hit", 0.0) / ideal if ideal else None,
        "answers_equal_first_front": [equal, compared],
        "errors": sorted({t.rec.error for t in turns if t.rec.error})[:5],
        "records": _relative(run_dir / f"multiturn-{front}" / "requests.jsonl"),  # RequestRecord lines (CDF plots)
        "turn_records": _relative(run_dir / f"multiturn-{front}" / "turns.jsonl"),  # + session, turn, answer
        **figures,
    }
    labels = RowLabels(
        "multiturn",
        "vllm-router" if front == "vllm-router" else "kvpush",
        "push",
        plan.connector,
        plan.session_rate,
        None,
        (plan.message_min + plan.message_max) // 2,
        (plan.answer_min + plan.answer_max) // 2,
        extra,
    )
    return build_row(summarize([t.rec for t in turns], duration), labels, git_commit(REPO))


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def plot_ttft_by_turn(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """TTFT p50 (and p90 dashed) by turn index, one colour per front."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, row in enumerate(rows):
        by = row.get("ttft_ms_by_turn") or {}
        xs = sorted(int(t) for t in by if by[t])
        for stat, style in (("p50", "-"), ("p90", "--")):
            ax.plot(
                xs, [by[str(x)][stat] for x in xs], style, color=f"C{i}", marker="o", label=f"{row['front']} {stat}"
            )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("multiturn: TTFT by turn (same sessions, prefix caches reset per front)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def section(rows: list[dict[str, Any]], results_dir: Path | None) -> list[str]:
    """The multiturn part of bench/README.md: one line per front, then the issue's targets."""
    out = [
        "| front | turns ok/failed | TTFT p50 turn 1 (ms) | TTFT p50 turns >= 2 (ms) | TPOT p50 (ms) | decode local hit"
        " / compute / transfer (tokens) | local hits / ideal reuse | answers = first front | routes"
        " | bypass predictions within ±20 % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_front: dict[str, dict[str, Any]] = {}
    for row in rows:
        front = str(row.get("front"))
        by_front[front] = row
        src = row.get("decode_prompt_tokens_by_source") or {}
        frac = row.get("local_hit_frac_of_ideal")
        equal = row.get("answers_equal_first_front") or [0, 0]
        out.append(
            f"| {front} | {row.get('turns_ok')}/{row.get('turns_failed')} | {_p50(row, 'ttft_ms_turn1')} "
            f"| {_p50(row, 'ttft_ms_turn2plus')} | {_p50(row, 'tpot_ms_all')} "
            f"| {src.get('local_cache_hit', 0):.0f} / {src.get('local_compute', 0):.0f} "
            f"/ {src.get('external_kv_transfer', 0):.0f} | {'-' if frac is None else f'{frac:.0%}'} "
            f"| {equal[0]}/{equal[1]} | {_routes(row.get('routes'))} | {accuracy_text(row.get('bypass_accuracy'))} |"
        )
    ours = _later_p50(by_front.get("kvpush-decider"))
    for other, target in (("vllm-router", 0.5), ("kvpush", 0.6)):
        theirs = _later_p50(by_front.get(other))
        if ours is not None and theirs:
            verdict = "met" if ours / theirs <= target else "not met"
            out.append(f"\nTTFT p50 turns >= 2, decider / {other}: {ours / theirs:.2f} (target <= {target}: {verdict})")
    decider = by_front.get("kvpush-decider")
    if decider is not None:
        out.append("\n" + accuracy_line(decider.get("bypass_accuracy")))
    if results_dir is not None and (results_dir / "multiturn-ttft-by-turn.png").exists():
        out += ["", "![multiturn TTFT by turn](results/multiturn-ttft-by-turn.png)"]
    return out


def accuracy_text(counts: Mapping[str, int] | None) -> str:
    """Shown as accurate/checked (pct); "0/0" before any bypass was checked, "-" without counters."""
    if counts is None:
        return "-"
    checked, accurate = counts["checked"], counts["accurate"]
    return f"{accurate}/{checked} ({accurate / checked:.0%})" if checked else "0/0"


def accuracy_line(counts: Mapping[str, int] | None) -> str:
    """The decider's bypass predictions against issue 11's target, stated as met / not met."""
    target = f"target >= {ACCURACY_TARGET:.0%} of bypass decisions"
    if counts is None:
        return f"bypass predictions within ±20 %, decider: no counters on its router ({target}: not measured)"
    if not counts["checked"]:
        return f"bypass predictions within ±20 %, decider: no bypass checked ({target}: not measured)"
    verdict = "met" if counts["accurate"] >= ACCURACY_TARGET * counts["checked"] else "not met"
    return f"bypass predictions within ±20 %, decider: {accuracy_text(counts)} ({target}: {verdict})"


def _routes(counts: Any) -> str:
    return "-" if not counts else ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _p50(row: dict[str, Any], key: str) -> str:
    dist = row.get(key)
    return "-" if not dist else f"{dist['p50']:.0f}"


def _later_p50(row: dict[str, Any] | None) -> float | None:
    dist = row.get("ttft_ms_turn2plus") if row else None
    return None if not dist else float(dist["p50"])
