"""Suite "overhead": what a front door adds, on zero-cost simulated workers (profile "zero").

Fronts on the same fake D: direct to D (baseline); kvpush push and vllm-router push on a P that answers like a
push prefill (`transfer_mode: push`, so vllm-router 0.1.17 learns the push identity and sends both legs at
once: every row records how the legs reached the workers, `wire_order`); kvpush pull and vllm-router pull on a
P that states pull. Closed loop at each concurrency, `repeats` times per point with the fronts' order rotated;
the front door's own CPU time and peak RSS are read from /proc for its process group.

The suite once also ran kvpush on other leg clients (`leg_clients`, aiohttp) and HTTP servers (`servers`,
granian); both lost their measurement and were deleted (bench/ANALYSIS.md, "Options deleted"). Rows of those runs
still carry `leg_client`/`server`, and the report labels them (`kvpush (aiohttp legs)`, `kvpush (granian)`).

The routers here probe their workers with a 10 s deadline (`--timeout health=10`, not the router's 1 s default):
at concurrency 256 on 2 cores the zero-cost simulated prefill, CPU-starved but alive, missed two 1 s probes in
a row and was taken down mid-run. Two timeouts in a row still take a worker down (router/workers/health.py
`probe_timeouts`, not a setting), so a live but starved simulator now has 2 x 10 s to answer.

`tracings` (e.g. `--set tracings=off,control,1,0.01`) runs one kvpush push front per tracing setting: `off`, a
sample ratio with OpenTelemetry tracing on (KVPUSH_TRACING, OTEL_TRACES_SAMPLER=parentbased_traceidratio and its
ratio, the SDK's batch settings as a user gets them), or `control`: a second untraced front, whose difference from
`off` is the noise floor of the comparison (an A/A pair). Spans go over OTLP/gRPC to a sink in a process of its own
(loadtest/bench/otlp_sink.py `SinkProcess`: it drops what it gets; its CPU is neither the router's nor the load
generator's); rows record `tracing`, and the report shows a traced front as its own (`kvpush (tracing 100 %)`) and
compares its CPU per request with the untraced one's (bench/README.md, "Tracing overhead"). Two identical routers
started apart differ by several per cent per request here (memory layout), so in a run that traces, the push
routers are started afresh, together, before each repeat: a repeat pairs routers of the same start, and the
repeats are independent starts. A traced router exports one full batch right after it starts (`_warm_export`: the
channel's connect and the export path's first call are not a request's cost). A traced point's off-loop threads
are read once its spans have gone out (after the batch delay, `export_wait_s`), its event loop at the end of the
load.

`kv_events` (`--set kv_events=off,on`, issue 24) runs one kvpush push front per setting: `on` starts the router
with `--kv-events` (it follows each worker's publisher on its HTTP port + 1000, with a replay socket on + 2000, and
forwards the session id on both legs). The simulated workers publish nothing, so this prices what events cost a
request when nothing arrives (the subscriber's sockets, its 0.1 s tick, the session header), not consuming them
(loadtest/micro/kv_events_rate.py prices that, the multiturn suite's replicas run both on real
engines). Such runs write suite "overhead-events" rows (each kvpush row records `kv_events`), kept out of the
overhead tables; bench/README.md's multi-turn replicas part compares CPU per request on and off.

`fixed_layout` (on by default) starts every process of the run with Linux's address-space randomization off
(loadtest/bench/aslr.py): two starts of the same router then lay out their memory the same way, where each random
layout carried its own cost per request for the life of the process. In one pair of runs it narrowed the A/A
per-repeat spread from 28 to 7 points at concurrency 1 and from 22 to 8 at 64 (runs 20261206T200313Z and
20261206T201231Z); the box's drift between points still widens some runs' floors (bench/ANALYSIS.md). Rows
record `layout` (`fixed`, or `random` where it is off or the kernel refused it).

`cprofile=True` runs the kvpush push router under cProfile (its rows are marked `profiled` and left out of
the targets) and writes router-profile.json next to summary.json: where its time went, by category.
"""

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import aslr, procs, profiling
from loadtest.bench.fronts import Front
from loadtest.bench.otlp_sink import SinkProcess
from loadtest.bench.point import Point, measure
from loadtest.job import REPO
from loadtest.results import RowLabels, git_commit
from stack.engines import Fleet
from stack.procs import ManagedProcess, free_port

PROFILE = "zero"
BATCH_DELAY_MS = 5000.0  # the OTel SDK's default OTEL_BSP_SCHEDULE_DELAY
CONTROL = "control"  # `tracings`: a second untraced push front, the A/A pair of `off` (docstring)
ROUTER_FLAGS = ("--timeout", "health=10")  # a starved but live simulator is not ejected (docstring)


@dataclass(frozen=True)
class OverheadPlan:
    input_len: int
    output_len: int
    levels: tuple[tuple[int, int], ...]  # (concurrency, requests)
    repeats: int = 3
    cprofile: bool = False
    tracings: tuple[str, ...] = ("off",)  # kvpush push fronts, one per tracing setting: off or a ratio (docstring)
    kv_events: tuple[str, ...] = ("off",)  # ... and per KV-event setting: off, on (docstring)
    fixed_layout: bool = True  # every process of the run starts with ASLR off (docstring)

    @property
    def suite(self) -> str:
        """The rows' suite: "overhead", or "overhead-events" when a front follows KV events."""
        return "overhead-events" if "on" in self.kv_events else "overhead"


# 5 fronts x 3 repeats x (300 + 1500 + 3000 requests): about 5-7 minutes on 2 idle cores.
FULL = OverheadPlan(128, 16, ((1, 300), (64, 1500), (256, 3000)))
SMOKE = OverheadPlan(32, 4, ((1, 5), (4, 8)), repeats=1)


@dataclass(frozen=True)
class KvpushVariant:
    """One kvpush router the suite starts: its mode, tracing and KV-event settings."""

    mode: str
    tracing: str = "off"  # off, control (a second untraced router), or the sample ratio of a traced router
    kv_events: str = "off"  # on: the router follows the workers' KV events

    @property
    def default(self) -> bool:
        return self.tracing == "off" and self.kv_events == "off"

    @property
    def traced(self) -> bool:
        return self.tracing not in ("off", CONTROL)

    @property
    def name(self) -> str:
        tags = [] if self.tracing == "off" else [CONTROL if self.tracing == CONTROL else f"trace{self.tracing}"]
        tags += [] if self.kv_events == "off" else ["events"]
        return "-".join([f"router-{self.mode}", *tags])


def kvpush_fronts(plan: OverheadPlan) -> list[KvpushVariant]:
    """A push front per tracing and KV-event setting the plan names, then one pull front on the defaults."""
    if not plan.tracings:
        raise ValueError("overhead: tracings must name off and/or sample ratios")
    for ratio in plan.tracings:
        if ratio not in ("off", CONTROL) and not _is_ratio(ratio):
            raise ValueError(f"overhead: tracings must be off, control or sample ratios in [0, 1], got {ratio!r}")
    if CONTROL in plan.tracings and "off" not in plan.tracings:
        raise ValueError("overhead: tracings=control is the A/A pair of off: name off too")
    if not plan.kv_events or set(plan.kv_events) - {"off", "on"}:
        raise ValueError(f"overhead: kv_events must name off and/or on, got {plan.kv_events}")
    if "on" in plan.kv_events and any(t != "off" for t in plan.tracings):
        raise ValueError("overhead: kv_events=on and tracings are separate runs (a traced run restarts its routers)")
    if plan.cprofile and any(t not in ("off", CONTROL) for t in plan.tracings):
        raise ValueError("overhead: cprofile and traced fronts are separate runs (a traced run restarts its routers)")
    if plan.cprofile and "on" in plan.kv_events:
        raise ValueError("overhead: cprofile profiles the default push router; run kv_events=on without it")
    push = [KvpushVariant("push", t, e) for e in dict.fromkeys(plan.kv_events) for t in dict.fromkeys(plan.tracings)]
    return [*push, KvpushVariant("pull")]


def export_wait_s(env: Mapping[str, str] = os.environ) -> float:
    """How long after a traced point its spans have surely been exported: the SDK's batch delay
    (OTEL_BSP_SCHEDULE_DELAY, ms, 5000 by default) and a second for the export itself."""
    try:
        delay_ms = float(env.get("OTEL_BSP_SCHEDULE_DELAY", "") or BATCH_DELAY_MS)
    except ValueError:
        delay_ms = BATCH_DELAY_MS
    return max(0.0, delay_ms) / 1000 + 1.0


def _is_ratio(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


@contextlib.contextmanager
def _router_env(front: KvpushVariant, sink: str | None = None) -> Iterator[None]:
    """The router started meanwhile uses the front's tracing (KVPUSH_TRACING and the OTEL_* sampler and endpoint:
    the sink's)."""
    traced = front.traced
    changes = {
        "KVPUSH_TRACING": "true" if traced else "false",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": front.tracing if traced else "0",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink or "http://127.0.0.1:9",
    }
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _start(fleet: Fleet, proc: ManagedProcess) -> ManagedProcess:
    fleet.start(proc)
    proc.wait_healthy(timeout=60.0)
    return proc


def _fronts(
    fleet: Fleet, plan: OverheadPlan, logs: Path, prof_out: Path | None, sink: str | None
) -> tuple[list[Front], str, dict[str, str]]:
    """The fronts, D's URL, and each kvpush front's KV-event setting by its base URL."""
    d_port = free_port()
    fleet.start(procs.sim_proc("sim-zero-d", "decode", d_port, PROFILE, "both", logs))
    p_urls: dict[str, str] = {}
    for mode in ("push", "pull"):
        p_port = free_port()
        fleet.start(procs.sim_proc(f"sim-zero-p-{mode}", "prefill", p_port, PROFILE, mode, logs))
        p_urls[mode] = procs.url(p_port)
    fleet.wait_all_healthy(timeout=60.0)
    d_url = procs.url(d_port)
    fronts = [Front("direct", "direct", d_url)]
    events: dict[str, str] = {}
    for k in kvpush_fronts(plan):
        out = prof_out if k.mode == "push" and k.default else None
        front = _kvpush_front(fleet, k, p_urls[k.mode], d_url, logs, out, sink)
        events[front.base] = k.kv_events
        fronts.append(front)
    binary = procs.vrouter_binary()
    if binary is None:
        hint = f"pip install vllm-router=={procs.VROUTER_VERSION} into .venv-vrouter"
        print(f"overhead: vllm-router not found ({hint}); its rows are skipped")
        return fronts, d_url, events
    for mode in ("push", "pull"):
        port, prom = free_port(), free_port()
        name = f"vllm-router-{mode}"
        proc = _start(fleet, procs.vrouter_proc(name, port, prom, p_urls[mode], d_url, logs, binary))
        fronts.append(Front("vllm-router", mode, procs.url(port), proc, p_urls[mode]))
    return fronts, d_url, events


WARM_EXPORT_REQUESTS = 180  # x 3 spans > the SDK's 512-span batch: exported at once (`_warm_export`)


def _warm_export(base: str, requests: int = WARM_EXPORT_REQUESTS, timeout_s: float = 30.0) -> None:
    """Makes a traced router, just started, export one full batch before it is measured: requests that come with a
    sampled client trace (parentbased: traced at any ratio) until the batch processor exports. A router's first
    export connects the gRPC channel and loads the export path, a one-off cost of ~20-30 ms that a fresh router per
    repeat would otherwise charge to its first point (at 1 % sampling, ~25 us a request)."""
    body = {"model": "m", "prompt": "warm the export path", "max_tokens": 1}
    with httpx.Client(timeout=timeout_s) as client:
        for _ in range(requests):
            trace_id, span_id = random.getrandbits(128) | 1, random.getrandbits(64) | 1
            headers = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}
            client.post(f"{base}/v1/completions", json=body, headers=headers).raise_for_status()
    time.sleep(1.0)  # the export, off the measured points


def _kvpush_front(
    fleet: Fleet,
    k: KvpushVariant,
    p_url: str,
    d_url: str,
    logs: Path,
    prof_out: Path | None,
    sink: str | None,
    start: int = 0,
) -> Front:
    """A kvpush router of variant `k` started (its `start`-th start: a fresh process per repeat, docstring)."""
    port, mode = free_port(), k.mode
    spec = f"{p_url},engine_id=sim-zero-p-{mode},side_port={p_url.rsplit(':', 1)[1]}"
    flags = (*ROUTER_FLAGS, "--kv-events") if k.kv_events == "on" else ROUTER_FLAGS
    name = k.name if not start else f"{k.name}-{start}"
    with _router_env(k, sink):
        proc = _start(fleet, procs.router_proc(name, port, mode, spec, d_url, logs, cprofile_to=prof_out, flags=flags))
    url = procs.url(port)
    if k.traced:
        _warm_export(url)
    return Front("kvpush", mode, url, proc, p_url, d_url, tracing=k.tracing)


def _restart_push_fronts(
    fleet: Fleet, fronts: list[Front], plan: OverheadPlan, logs: Path, sink: str | None, start: int
) -> list[Front]:
    """The fronts with every kvpush push router stopped and started afresh, all of them before any load (a traced
    run's repeat pairs routers of one start; docstring). The others stay as they are."""
    variants = {k.tracing: k for k in kvpush_fronts(plan) if k.mode == "push"}
    out = []
    for front in fronts:
        k = variants.get(front.tracing or "off")
        if front.router != "kvpush" or front.mode != "push" or k is None or not (front.p_url and front.d_url):
            out.append(front)
            continue
        if front.proc is not None:
            front.proc.stop()
        out.append(_kvpush_front(fleet, k, front.p_url, front.d_url, logs, None, sink, start))
    return out


def run(plan: OverheadPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    prof_out = run_dir / "router-push.prof" if plan.cprofile else None
    run_dir.mkdir(parents=True, exist_ok=True)
    traced = any(t not in ("off", CONTROL) for t in plan.tracings)
    with contextlib.ExitStack() as running:
        fixed = running.enter_context(aslr.fixed_layout()) if plan.fixed_layout else False
        if plan.fixed_layout and not fixed:
            print("overhead: the kernel refused a fixed address-space layout; the run's processes start randomized")
        fleet = running.enter_context(Fleet(logs))
        sink = running.enter_context(SinkProcess()).endpoint if traced else None
        fronts, d_url, events = _fronts(fleet, plan, logs, prof_out, sink)
        profiled = [f.proc.pid for f in fronts if _is_profiled(f) and f.proc and f.proc.pid and prof_out]
        for pid in profiled:
            os.kill(pid, signal.SIGUSR1)  # start-up done: profile from here on
        k = len(fronts)
        for li, (conc, n) in enumerate(plan.levels):
            for rep in range(plan.repeats):
                if traced and (li or rep):  # the first repeat's routers are the ones just started
                    fronts = _restart_push_fronts(fleet, fronts, plan, logs, sink, li * plan.repeats + rep)
                    events.update({f.base: "off" for f in fronts if f.router == "kvpush" and f.base not in events})
                for j in range(k):
                    front = fronts[(j + rep + li) % k]
                    at = (rep, j, run_id, d_url, run_dir, summary, progress)
                    rows.append(_point(front, plan, conc, n, *at, kv_events=events.get(front.base), fixed=fixed))
        for pid in profiled:
            os.kill(pid, signal.SIGUSR2)  # stop and write the profile
            _wait_for(prof_out)
    if prof_out is not None and prof_out.exists():
        done = plan.repeats * sum(n + min(2 * c, 200) for c, n in plan.levels)  # warm-up requests included
        data = profiling.breakdown(prof_out, requests=done)
        data["git_commit"], data["run_id"] = git_commit(REPO), run_id
        profiling.write(data, summary.parent / "router-profile.json")
        print(f"overhead: router profile of {done} requests -> {summary.parent / 'router-profile.json'}")
    return rows


def _is_profiled(front: Front) -> bool:
    """The one front run under cProfile with `cprofile=True`: the untraced kvpush push router."""
    return front.router == "kvpush" and front.tracing in (None, "off") and front.mode == "push"


def _wait_for(path: Path | None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path is not None and time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            time.sleep(0.5)  # let the writer finish
            return
        time.sleep(0.1)


def _point(
    front: Front,
    plan: OverheadPlan,
    conc: int,
    n: int,
    rep: int,
    order: int,
    run_id: str,
    d_url: str,
    run_dir: Path,
    summary: Path,
    progress: bool,
    kv_events: str | None = None,
    fixed: bool = False,
) -> dict[str, Any]:
    extra: dict[str, Any] = {"run_id": run_id, "profile": PROFILE, "repeat": rep, "order": order}
    extra["layout"] = "fixed" if fixed else "random"
    if kv_events is not None:
        extra["kv_events"] = kv_events
    if front.tracing is not None:
        extra["tracing"] = front.tracing
    if any(t not in ("off", CONTROL) for t in plan.tracings):
        extra["tracing_run"] = True  # the report's tracing table reads such runs, the overhead tables do not
    if plan.cprofile:
        extra["profiling_run"] = True  # the report keeps such runs out of the overhead tables
        if _is_profiled(front):
            extra["profiled"] = True
    labels = RowLabels(plan.suite, front.router, front.mode, "sim", None, conc, plan.input_len, plan.output_len, extra)
    point = Point(
        labels,
        front.base,
        n,
        seed=2000 + 10 * rep + order,
        warmup=min(2 * conc, 200),
        timeout_s=60.0,
        router_timings=front.router == "kvpush",
        legs_of=(front.p_url, d_url) if front.p_url else None,
    )
    pid = front.proc.pid if front.proc else None
    if pid is None or front.tracing is None:
        return measure(point, run_dir, summary, progress, cpu_pid=pid)
    before, loop_before = procs.side_threads_cpu_ns(pid), procs.loop_thread_cpu_ns(pid)
    loop_after: list[int] = []
    done = n + point.warmup

    def side_threads(_: Any) -> dict[str, Any]:
        """The router's CPU per request in us, per thread: on its event loop (read when the load was done, with the
        process's CPU) and off it (export thread, gRPC's threads: read once the point's last batch has gone out);
        in ns, unlike the process's whole CPU, so a few us show (bench/README.md "Tracing overhead")."""
        loop = ((loop_after or [procs.loop_thread_cpu_ns(pid)])[0] - loop_before) / 1e3 / done
        if front.tracing not in ("off", CONTROL):
            time.sleep(export_wait_s())
        side = (procs.side_threads_cpu_ns(pid) - before) / 1e3 / done
        return {"side_threads_us_per_req": side, "loop_thread_us_per_req": loop}

    def loaded() -> None:
        loop_after.append(procs.loop_thread_cpu_ns(pid))

    return measure(point, run_dir, summary, progress, cpu_pid=pid, finish=side_threads, loaded=loaded)
