"""Suite "multiturn": multi-turn chat sessions on real vLLM CPU engines (one prefill, two decodes, prefix caching
on), through three fronts in turn with the same sessions and arrival times:

- kvpush with the session-affinity decider (push; short uncached suffixes bypass prefill on the decode that holds
  the conversation);
- kvpush without a decider (push, every turn prefilled and transferred whole);
- vllm-router 0.1.17 in push mode (it detects push from prefill's `transfer_mode`) with `consistent_hash` on
  X-Session-ID for decode (when its binary is installed: `make bench` puts it in .venv-vrouter).

P runs on core 0, both decodes share core 1. Every engine reports cached tokens per request
(--enable-prompt-tokens-details) and runs with VLLM_SERVER_DEV_MODE=1, so the prefix caches are reset
(POST /reset_prefix_cache) before each front: no front profits from an earlier front's turns. The plan's `repeats`
(2 by default) each take new sessions (seed + repeat) and, every other time, the fronts in reverse order, so that
drift on the shared cores shows as spread between repeats (loadtest/report/multiturn.py folds them: median and
range, targets judged on the ratio within each repeat). One row per front and repeat:
TTFT per turn index, TTFT over turns >= 2, TPOT, decode's prompt tokens by source (both decodes summed), the
share of an ideal router's reusable tokens that were local cache hits on decode, how many answers equal the
first front's (greedy: all must) and, for a kvpush front, the decider's bypass predictions within 20 % of the
actual uncached tokens (its router's kvpush_bypass_accurate / kvpush_bypass_checked counters at the end of the
run; issue 11's target: >= 90 % of bypass decisions). A PNG of TTFT p50 by turn goes next to summary.json.

With `replicas=2` (issue 24) the engines publish their KV events and the fronts are the decider's with events on
(one router), with events on behind two router replicas that take a conversation's turns in turn, and with events
off (loadtest/bench/suites/multiturn_replicas.py); those rows are suite "multiturn-replicas".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest import multiturn, promtext
from loadtest.bench.point import kv_sources, scrape
from loadtest.bench.procs import url, vllm_lock, vrouter_binary
from loadtest.bench.suites import multiturn_checks as checks_mod
from loadtest.bench.suites import multiturn_replicas as replicas_mod
from loadtest.job import REPO
from loadtest.records import write_jsonl
from loadtest.report import multiturn as report_multiturn
from loadtest.results import RowLabels, append_rows, build_row, git_commit
from loadtest.stats import summarize
from stack.engines import KV_EVENT_OFFSETS, Engine, Fleet
from stack.family import PdFamily, pd_family, start_family
from stack.link import bypass
from stack.link.calibrate import calibrate
from stack.link.fabric import Link
from stack.link.meter import NicMeter
from stack.link.plan import LinkPlan, Shaping, nominal_prefill_s, preset, resolve
from stack.local import StackOptions, ensure_model
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec, StartupError, free_port
from stack.routers import Router, router_spec
from stack.tiny_model import SIZES

DETAILS = "--enable-prompt-tokens-details"
CONNECTORS = {"upstream-push": ("NixlPushConnector", None), "kvpush-push": ("KvpushConnector", "connector.plugin")}
FRONTS = ("kvpush", "kvpush-decider", "vllm-router")  # the first one is the answers' reference


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
    system_shared: bool = False  # every session opens with the same system prompt (system_tokens of it)
    seed: int = 11
    connector: str = "upstream-push"  # or "kvpush-push" (our connector on the three engines)
    model_size: str = "bench"
    max_model_len: int = 8192  # ten turns of up to 500 + 128 tokens
    decider_options: tuple[tuple[str, float], ...] = ()  # e.g. (("bypass_max_uncached_tokens", 256),)
    vrouter_decode_policy: str = "consistent_hash"
    timeout_s: float = 300.0
    repeats: int = 2  # each with new sessions (seed + repeat); odd repeats take the fronts in reverse order
    warmup_sessions: int = 4  # short 2-turn sessions through every front first (P-D handshakes, first shapes)
    link: str = ""  # a stack.link preset (ethernet-25g-like, ...): engines in namespaces behind a shaped link
    link_calibrate_tokens: int = 1024  # the prompt P's prefill is timed on to resolve the preset's rate
    replicas: int = 1  # 2-4: the KV-event fronts, one of them behind this many router replicas (docstring)
    events_off_row: bool = True  # with replicas: the decider with events off too
    answer_tokenizer: bool = True  # the KV-event fronts' decider gets the model's tokenizer (option `tokenizer`):
    # it decides on the prompts' exact token ids (issue 40; docs/multi-turn.md, "The exact path")
    api: str = "chat"  # "chat" | "completions" | "both" (even sessions chat, odd ones completions)
    burst: int = 1  # sessions arrive in groups of this many at once
    peer_kv_aware: bool = False  # with replicas: vllm-router's kv_aware on one and on `replicas` routers too
    estimate_row: bool = False  # with replicas: one events router without the tokenizer (CPU on / off)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("multiturn repeats: at least 1")
        if self.link:
            preset(self.link)  # ValueError naming the known presets
        if not 1 <= self.replicas <= 4:
            raise ValueError("multiturn replicas: 1 to 4")

    @property
    def suite(self) -> str:
        """The rows' suite: "multiturn-replicas" with replicas (on a link too: its rows carry the link's record),
        else "multiturn-link" on a link, else "multiturn" (the loopback section stays as it is)."""
        return "multiturn-replicas" if self.replicas > 1 else "multiturn-link" if self.link else "multiturn"

    @property
    def fronts(self) -> tuple[str, ...]:
        """The fronts in the order of even repeats; the first is the answers' reference."""
        if self.replicas < 2:
            return FRONTS
        return replicas_mod.fronts(self.replicas, self.events_off_row, self.peer_kv_aware, self.estimate_row)

    def shape(self, repeat: int = 0) -> multiturn.SessionShape:
        return multiturn.SessionShape(
            sessions=self.sessions,
            session_rate=self.session_rate,
            turns=(self.turns_min, self.turns_max),
            message_tokens=(self.message_min, self.message_max),
            answer_tokens=(self.answer_min, self.answer_max),
            think_s=self.think_s,
            system_tokens=self.system_tokens,
            seed=self.seed + repeat,
            system_shared=self.system_shared,
            api=self.api,
            burst=self.burst,
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
    repeats=1,
    warmup_sessions=0,
)


def engine_family(plan: MultiTurnPlan, model: Path) -> PdFamily:
    """mt-p0 on core 0, mt-d0 and mt-d1 sharing core 1, all on the plan's connector."""
    connector, module = CONNECTORS[plan.connector]
    # on a link our connector runs NIXL's event-driven progress thread (decode moves the bytes as they arrive)
    extra = {"progress": "thread"} if plan.link and module is not None else None
    return pd_family(
        "mt",
        model,
        connector,
        module=module,
        n_decode=2,
        extra_args=(DETAILS,),
        max_model_len=plan.max_model_len,
        connector_extra=extra,
        kv_events=KV_EVENT_OFFSETS if plan.replicas > 1 else None,
    )


@contextlib.contextmanager
def maybe_link(plan: MultiTurnPlan) -> Iterator[Link | None]:
    """The plan's link, open (shaped at the nominal prefill until calibrated), or None on loopback."""
    if not plan.link:
        yield None
        return
    kv = plan.link_calibrate_tokens * SIZES[plan.model_size].kv_bytes_per_token()
    first = resolve(preset(plan.link), prefill_s=nominal_prefill_s(plan.link_calibrate_tokens), kv_bytes=kv)
    with Link(first.shaping or Shaping.for_rate(1e9)) as link:
        yield link


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def on_link(plan: MultiTurnPlan, link: LinkPlan) -> MultiTurnPlan:
    """`plan` with the decider's bypass threshold derived from the calibrated link (stack.link.bypass), unless
    the plan set one by hand."""
    options = bypass.decider_options(plan.decider_options, link, plan.link_calibrate_tokens)
    return replace(plan, decider_options=options)


def decider_yaml(plan: MultiTurnPlan, block_tokens: int | None = None, tokenizer: Path | None = None) -> str:
    """The router's decider block; the engines' block size unless the plan sets one; `tokenizer`: the model's
    directory (its tokenizer.json), for a decider that follows KV events."""
    options = dict(plan.decider_options)
    if block_tokens is not None:
        options.setdefault("block_tokens", block_tokens)
    lines = ["decider:", "  name: session-affinity"] + [f"  {k}: {v:g}" for k, v in options.items()]
    lines += [f"  tokenizer: {json.dumps(str(tokenizer))}"] if tokenizer is not None else []
    return "\n".join(lines) + "\n"


def block_size(engine_url: str) -> int | None:
    """The engine's KV block size, from its vllm:cache_config_info labels."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'block_size="' in line:
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    return None


def kvpush_proc(
    name: str, port: int, prefill: str, decodes: list[str], logs: Path, config: Path | None, level: str = "warning"
) -> ManagedProcess:
    spec = router_spec(port, "push", [prefill], decodes, "--log-level", level, name=name, config=config)
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


@dataclass(frozen=True)
class _Front:
    """A started front: its router replicas' base URLs (turns go to them in turn) and their process ids."""

    name: str
    bases: tuple[str, ...]
    pids: tuple[int, ...] = ()
    logs: tuple[Path, ...] = ()  # a decider front's routers' logs (INFO: each checked bypass, multiturn_checks)

    @property
    def kvpush(self) -> bool:
        return not self.name.startswith("vllm-router")


def _start_front(
    front: str, plan: MultiTurnPlan, fleet: Fleet, p: Engine, decodes: list[str], logs: Path, run_dir: Path, model: Path
) -> _Front | None:
    prefill = p.engine_spec.prefill_arg()
    if front in (replicas_mod.PEER, replicas_mod.PEER_REPLICAS):
        return _start_peer(front, plan, fleet, p, decodes, logs)
    if front == "vllm-router":
        binary = vrouter_binary()
        if binary is None:
            print("multiturn: vllm-router not found (.venv-vrouter, `make bench` installs it); its row is skipped")
            return None
        port = free_port()
        proc = fleet.start(vrouter_push_proc(plan, port, free_port(), p.url, decodes, logs, binary))
        proc.wait_healthy(timeout=120.0)
        return _Front(front, (url(port),))
    config = None
    if front != "kvpush":
        config = run_dir / f"multiturn-{front}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        events = replicas_mod.kv_events_yaml() if replicas_mod.uses_events(front) else ""
        tokenizer = model if events and plan.answer_tokenizer and front != replicas_mod.ESTIMATE else None
        config.write_text(decider_yaml(plan, block_size(p.url), tokenizer) + events, encoding="utf-8")
    bases, pids, paths = [], [], []
    level = "warning" if config is None else "info"  # a decider logs each checked bypass at INFO
    for i in range(replicas_mod.replicas_of(front, plan.replicas)):
        port, name = free_port(), f"router-mt-{front}-{i}"
        proc = fleet.start(kvpush_proc(name, port, prefill, decodes, logs, config, level))
        proc.wait_healthy(timeout=60.0)
        bases.append(url(port))
        pids += [proc.pid] if proc.pid else []
        paths.append(logs / f"{name}.log")
    return _Front(front, tuple(bases), tuple(pids), tuple(paths) if config is not None else ())


def _start_peer(
    front: str, plan: MultiTurnPlan, fleet: Fleet, p: Engine, decodes: list[str], logs: Path
) -> _Front | None:
    """vllm-router's kv_aware routers (multiturn_replicas.vrouter_kv_argv), `replicas_of` of them."""
    binary = vrouter_binary()
    if binary is None:
        print(f"multiturn: vllm-router not found (.venv-vrouter); {front} is skipped")
        return None
    bases = []
    for i in range(replicas_mod.replicas_of(front, plan.replicas)):
        port = free_port()
        argv = replicas_mod.vrouter_kv_argv(binary, p.url, decodes, port, free_port(), block_size(p.url) or 16)
        log = logs / f"{front}-{i}.log"
        proc = fleet.start(
            ManagedProcess(ProcessSpec(f"{front}-{i}", tuple(argv), _env(), log, f"{url(port)}/health", REPO))
        )
        try:
            proc.wait_healthy(timeout=120.0)
        except StartupError as error:  # the peer's flags or version: its rows are skipped, ours still run
            print(f"multiturn: {front} did not start ({error}); its rows are skipped")
            return None
        bases.append(url(port))
    return _Front(front, tuple(bases))


def run(plan: MultiTurnPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=plan.model_size))
    rows: list[dict[str, Any]] = []
    per_token = SIZES[plan.model_size].kv_bytes_per_token()
    with vllm_lock(), maybe_link(plan) as link, Fleet(logs, base_env=_env() | {"VLLM_SERVER_DEV_MODE": "1"}) as fleet:
        family = start_family(fleet, engine_family(plan, model), timeout=600.0, link=link)
        engines, p, decodes = list(family.members), family.prefills[0], list(family.decodes)
        link_record: dict[str, Any] = {}
        if link is not None:
            cal = calibrate(
                link, preset(plan.link), p.url, prompt_tokens=plan.link_calibrate_tokens, kv_bytes_per_token=per_token
            )
            link_record = cal.record()
            plan = on_link(plan, cal.plan)
            link_record["link_bypass_max_uncached_tokens"] = dict(plan.decider_options)[bypass.OPTION]
            print(f"multiturn: on the link {link_record}")
        ratio = words_per_token(p.url)
        fronts = plan.fronts
        started = {f: _start_front(f, plan, fleet, p, [d.url for d in decodes], logs, run_dir, model) for f in fronts}
        for one in started.values():
            if one is not None and plan.warmup_sessions:
                asyncio.run(multiturn.run_sessions(_targets(one, ratio, plan), warmup(plan)))
        for repeat in range(plan.repeats):
            shape = plan.shape(repeat)
            sessions, prefix = multiturn.plan_sessions(shape), multiturn.session_prefix(shape.seed)
            order = fronts if repeat % 2 == 0 else tuple(reversed(fronts))
            ran: dict[str, _FrontRun] = {}
            checked: dict[str, dict[str, Any]] = {}
            for front in order:
                one = started[front]
                if one is not None:
                    meter = NicMeter(link, p.engine_spec.name) if link is not None else None
                    ran[front] = _run_front(one, plan, sessions, prefix, engines, decodes, ratio, progress)
                    checked[front] = dict(link_record)
                    if meter is not None:
                        kv = int(ran[front].sources.get("external_kv_transfer", 0.0)) * per_token
                        checked[front].update(meter.check(kv).record())
            baseline = ran[fronts[0]].turns if fronts[0] in ran else []
            for front in fronts:
                if front in ran:
                    rows.append(_row(plan, ran[front], baseline, repeat, run_id, run_dir, checked[front]))
            if plan.replicas > 1 and repeat == plan.repeats - 1:
                _stop_one(started.get(replicas_mod.REPLICAS), decodes[-1], rows)
    append_rows(summary, rows)
    report_multiturn.plot_ttft_by_turn(rows, summary.parent / f"{plan.suite}-ttft-by-turn.png")
    return rows


def _stop_one(front: _Front | None, engine: Engine, rows: list[dict[str, Any]]) -> None:
    """The run is over: stop one decode and note on the last replicas row how soon every replica's view of it
    emptied (multiturn_replicas.stop_reflected)."""
    if front is None:
        return
    found = replicas_mod.stop_reflected(engine, front.bases)
    print(f"multiturn: {engine.engine_spec.name} stopped: {found}")
    mine = [row for row in rows if row.get("front") == front.name]
    if mine:
        mine[-1]["engine_stop_reflected"] = found


def _targets(front: _Front, ratio: float, plan: MultiTurnPlan) -> list[multiturn.Target]:
    return [multiturn.Target(base, "tiny", ratio, plan.timeout_s) for base in front.bases]


def warmup(plan: MultiTurnPlan) -> list[multiturn.Session]:
    """Sessions that warm every front before the first measured one (the first push to each decode pays its NIXL
    handshake with the prefill, and the first front would pay it alone); their ids never meet a measured one's."""
    shape = multiturn.SessionShape(
        sessions=plan.warmup_sessions,
        session_rate=10.0,
        turns=(2, 2),
        message_tokens=(plan.message_min, plan.message_min),
        answer_tokens=(plan.answer_min, plan.answer_min),
        think_s=0.0,
        seed=plan.seed + 1000,
    )
    return multiturn.plan_sessions(shape)


@dataclass
class _FrontRun:
    front: str
    turns: list[multiturn.TurnRecord]
    duration: float
    sources: dict[str, float]  # decode's prompt tokens by source during this front's run
    routes: dict[str, int] | None  # kvpush fronts: how its router served this run's turns
    accuracy: dict[str, int] | None  # the decider's bypass counters' growth during this run
    replicas: int = 1
    events: dict[str, Any] | None = None  # kvpush fronts: router CPU and KV-event figures (multiturn_replicas)
    by_replica: list[dict[str, int]] | None = None  # kvpush fronts: each replica's turns and bypasses
    bypass_checks: dict[str, Any] | None = None  # decider fronts: each bypass's prediction (multiturn_checks)


def _run_front(
    front: _Front,
    plan: MultiTurnPlan,
    sessions: list[multiturn.Session],
    prefix: str,  # the sessions' id prefix: their requests among the router's records
    engines: list[Engine],
    decodes: list[Engine],
    ratio: float,
    progress: bool,
) -> _FrontRun:
    kvpush = front.kvpush
    reset_caches(engines)
    if replicas_mod.uses_events(front.name):
        settled = replicas_mod.settle_views([e.url for e in engines], front.bases)
        print(f"multiturn {front.name}: views empty after the reset in {settled} s (None: not within 10 s)")
    before, counted = decode_sources(decodes), _accuracy(front) if kvpush else None
    read = replicas_mod.read(front.bases, front.pids) if kvpush else None
    turns, duration = asyncio.run(multiturn.run_sessions(_targets(front, ratio, plan), sessions))
    after = decode_sources(decodes)
    if progress:
        print(f"multiturn {front.name}: {sum(t.rec.ok for t in turns)}/{len(turns)} turns ok in {duration:.1f} s")
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    accuracy = grown(counted, _accuracy(front)) if kvpush else None
    served = _summed_counts(routes(base, prefix) for base in front.bases) if kvpush else None
    by_replica = [replicas_mod.replica_routes(base, prefix) for base in front.bases] if kvpush else None
    checks = None
    if front.logs:
        bypassed = set().union(*(checks_mod.bypass_ids(base, prefix) for base in front.bases))
        checks = checks_mod.verdict(checks_mod.logged_checks(front.logs, prefix), bypassed)
        print(f"multiturn {front.name}: bypass checks {checks}")
    events = None
    if read is not None:
        done = replicas_mod.read(front.bases, front.pids)
        events = replicas_mod.figures(read, done, duration, len(turns), len(front.bases))
        if replicas_mod.uses_events(front.name):
            events["reset_reflected"] = replicas_mod.reset_reflected(decodes[0].url, front.bases)
        if progress:
            print(f"multiturn {front.name}: {events}")
    return _FrontRun(
        front.name, turns, duration, sources, served, accuracy, len(front.bases), events, by_replica, checks
    )


def _accuracy(front: _Front) -> dict[str, int] | None:
    """The bypass counters summed over the front's replicas (None when one has none)."""
    found = [scrape_bypass_accuracy(base) for base in front.bases]
    if any(f is None for f in found):
        return None
    return _summed_counts(f for f in found if f is not None)


def _summed_counts(parts: Iterator[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def grown(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """What a router's counters gained between two scrapes (None when either scrape had none)."""
    if before is None or after is None:
        return after if before is None else None
    return {k: after[k] - before.get(k, 0) for k in after}


def routes(router_url: str, prefix: str = "") -> dict[str, int]:
    """How the kvpush router served the requests whose id starts with `prefix` (its /debug/timings records by
    mode: push, bypass, ...)."""
    try:
        records = httpx.get(f"{router_url}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no route counts from {router_url}: {error}")
        return {}
    out: dict[str, int] = {}
    for record in records:
        if str(record.get("request_id", "")).startswith(prefix):
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
    `_total` suffix), and {"predicted_cached", "actual_cached"} (the checked bypasses' summed cached tokens, as
    predicted and as decode reported them) where the router exports them; None when it exports neither of the
    first two (it runs no decider)."""
    names = {name for name, _ in samples}
    counts: dict[str, int] = {}
    for key, metric in (*((k, k) for k in ("checked", "accurate")), *_CACHED):
        found = [n for n in (f"kvpush_bypass_{metric}_total", f"kvpush_bypass_{metric}") if n in names]
        if found:
            counts[key] = int(promtext.total(samples, found[0]))
        elif key in ("checked", "accurate"):
            return None
    return counts


_CACHED = (("predicted_cached", "predicted_cached_tokens"), ("actual_cached", "actual_cached_tokens"))


def _row(
    plan: MultiTurnPlan,
    ran: _FrontRun,
    baseline: list[multiturn.TurnRecord],
    repeat: int,
    run_id: str,
    run_dir: Path,
    more: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One front's row; `more`: the link's record and bytes check, when on a link."""
    front, turns, sources = ran.front, ran.turns, ran.sources
    where = run_dir / f"{plan.suite}-{front}-r{repeat}"
    multiturn.write_turns(where / "turns.jsonl", turns)
    write_jsonl(where / "requests.jsonl", [t.rec for t in turns])
    figures = multiturn.by_turn(turns)
    ideal = figures["ideal_reusable_tokens"]
    equal, compared = multiturn.answers_agree(turns, baseline)
    extra: dict[str, Any] = {
        "run_id": run_id,
        "front": front,
        "repeat": repeat,
        "decider": "session-affinity" if front.startswith("kvpush-decider") else None,
        "replicas": ran.replicas,
        "kv_events": replicas_mod.uses_events(front),
        "answer_tokenizer": replicas_mod.uses_events(front)
        and plan.answer_tokenizer
        and front != replicas_mod.ESTIMATE,
        "model": plan.model_size,
        "plan": asdict(plan),
        "decode_prompt_tokens_by_source": sources,
        "local_hit_frac_of_ideal": sources.get("local_cache_hit", 0.0) / ideal if ideal else None,
        "answers_equal_first_front": [equal, compared],
        "errors": sorted({t.rec.error for t in turns if t.rec.error})[:5],
        "records": _relative(where / "requests.jsonl"),  # RequestRecord lines (CDF plots)
        "turn_records": _relative(where / "turns.jsonl"),  # + session, turn, answer
        "routes": ran.routes,
        "bypass_by_replica": ran.by_replica,
        "bypass_accuracy": ran.accuracy,
        "bypass_checks": ran.bypass_checks,
        **figures,
        **(ran.events or {}),
        **(more or {}),
    }
    labels = RowLabels(
        plan.suite,
        "vllm-router" if front.startswith("vllm-router") else "kvpush",
        "push",
        plan.connector,
        plan.session_rate,
        None,
        (plan.message_min + plan.message_max) // 2,
        (plan.answer_min + plan.answer_max) // 2,
        extra,
    )
    return build_row(summarize([t.rec for t in turns], ran.duration), labels, git_commit(REPO))


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
