"""The processes a fault row runs against: a router and its workers (vLLM engines or hostile stand-ins), with
what the matrix reads from each (router gauges, engine running requests and KV usage) and the faults it can
inject into a worker (SIGSTOP, SIGCONT, SIGKILL on its process group)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest import promtext
from stack.engines import KV_EVENT_OFFSETS, EngineSpec
from stack.link.fabric import Link
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, router_spec

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVPUSH_TEST_CACHE", REPO / ".cache" / "kvpush"))
LOGS = CACHE / "faults-logs"
MODEL_DIR = CACHE / "models" / "tiny"  # the beds' model (and tokenizer), built before any router starts
STANDIN_MODULE = "loadtest.faults.hostile_workers"  # run as a command, never imported here
KVPUSH_CONNECTOR = ("KvpushConnector", "connector.plugin")
# D holds a quarantined or unfed registration this long (default 120 s): rows settle in seconds, not minutes.
KV_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BedShape:
    """How a vLLM bed differs from the plain one: its engines' name prefix, each prefill's own vLLM flags, and
    which prefills (by index) the router gets (None: all)."""

    label: str = "faults"
    prefill_args: tuple[tuple[str, ...], ...] = ()
    routed: tuple[int, ...] | None = None
    link: bool = False  # every engine in its own network namespace behind one shaped link (stack.link)
    prefill_deadline: float | None = None  # the router's prefill leg deadline on this bed (None: the matrix's)
    decode_args: tuple[str, ...] = ()  # the decode engine's own vLLM flags
    kv_events: bool = False  # every engine publishes its KV events (stack.engines.KV_EVENT_OFFSETS)
    router_config: Mapping[str, Any] = field(default_factory=dict)  # the bed's router settings over the matrix's


# The preemption bed (issue 42 item 4): p1 advances 2 prompt tokens a step for each of up to two requests (a budget
# of 4 split by the long-prefill threshold) in a KV cache of 16 usable blocks of 128 tokens (and vLLM's null
# block: the least vLLM accepts for a 2048-token length): two ten-block prompts outgrow it together and vLLM
# preempts one mid-prefill, after partial WRITEs. Only p1 is routed; p0 (plain) answers as one instance.
PREEMPT_SHAPE = BedShape(
    "faults-preempt",
    (
        (),
        (
            *("--max-num-batched-tokens", "4", "--long-prefill-token-threshold", "2", "--max-num-seqs", "2"),
            *("--num-gpu-blocks-override", "17"),
        ),
    ),
    routed=(1,),
)
# The rank bed (issue 42 item 1): p0 a TP=2 prefill (the router is told its size), p1 a plain one, both routed.
# A hung rank leaves p0's API process answering its health probe: the router's prefill deadline ends its legs,
# 20 s here (default 300 s) so the row takes seconds, not minutes.
TP_SHAPE = BedShape("faults-tp", (("--tensor-parallel-size", "2"), ()), prefill_deadline=20.0)
# The link bed (issue 42 item 3): the plain bed with each engine in its own namespace, KV over UCX TCP on a
# 200 Mbit/s link (stack.link); the router stays in the root namespace (its legs cross the link too).
LINK_SHAPE = BedShape("faults-link", link=True)
# The data-parallel bed (issue 42 item 1): p0 a DP=2 prefill (two engine cores, EngineCore_DP0 and _DP1, one
# HTTP server; the router is told dp=2 and pins each leg's rank), p1 a plain one, both routed.
DP_SHAPE = BedShape("faults-dp", (("--data-parallel-size", "2"), ()), prefill_deadline=20.0)
# The decode-rank bed (issue 42 item 1): the decode a TP=2 engine (each prefill writes each decode rank its KV
# head: P1-D2 fan-out), both prefills plain.
DECODE_TP_SHAPE = BedShape("faults-dtp", decode_args=("--tensor-parallel-size", "2"))
LINK_RATE_BIT_S = 2e8


@dataclass
class EngineState:
    """One worker after a row: None where the worker does not say (a stand-in has no KV; a dead one nothing)."""

    alive: bool
    running: float | None
    kv_usage: float | None

    @property
    def idle(self) -> bool:
        return not self.alive or ((self.running or 0.0) == 0.0 and (self.kv_usage or 0.0) == 0.0)


@dataclass
class Worker:
    role: str
    name: str
    url: str
    handle: ManagedProcess
    kind: str  # "vllm" or "standin"
    router_arg: str  # the router's --prefill SPEC or --decode URL
    killed: bool = False

    @property
    def pid(self) -> int:
        pid = self.handle.pid
        if pid is None:
            raise RuntimeError(f"{self.name} is not started")
        return pid

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def hang(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        self.killed = True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)

    def state(self, client: httpx.Client) -> EngineState:
        if self.killed or self.handle.exit_code() is not None:
            return EngineState(False, None, None)
        try:
            if self.kind == "standin":
                stats = client.get(f"{self.url}/stats", timeout=5.0).json()
                return EngineState(True, float(stats["running"]), None)
            samples = promtext.parse(client.get(f"{self.url}/metrics", timeout=5.0).text)
        except httpx.HTTPError:
            return EngineState(True, None, None)  # alive but not answering (hung)
        running = promtext.total(samples, "vllm:num_requests_running") + promtext.total(
            samples, "vllm:num_requests_waiting"
        )
        return EngineState(True, running, promtext.total(samples, "vllm:kv_cache_usage_perc"))


@dataclass
class RouterProc:
    handle: ManagedProcess
    url: str
    config: dict[str, Any] = field(default_factory=dict)

    def gauges(self, client: httpx.Client) -> dict[str, float]:
        samples = promtext.parse(client.get(f"{self.url}/metrics", timeout=5.0).text)
        return {
            "in_flight": promtext.total(samples, "kvpush_in_flight"),
            "queued": promtext.total(samples, "kvpush_admission_queued"),
            "worker_in_flight": promtext.total(samples, "kvpush_worker_in_flight"),
        }

    def ready(self, client: httpx.Client) -> bool:
        try:
            return client.get(f"{self.url}/ready", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Bed:
    router: RouterProc
    prefills: list[Worker]
    decodes: list[Worker]
    started: list[ManagedProcess] = field(default_factory=list)
    link: Link | None = None  # the shaped link the engines sit behind (bed `vllm-link`), else None

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefills, *self.decodes]

    def of(self, role: str) -> list[Worker]:
        return self.prefills if role == "prefill" else self.decodes


def _launch(handle: ManagedProcess, started: list[ManagedProcess]) -> ManagedProcess:
    """Start a child, remember it for stop_all(), and wait until it answers its ready URL."""
    started.append(handle)
    handle.start()
    handle.wait_healthy(60.0)
    return handle


def start_router(
    prefill_args: Sequence[str], decode_args: Sequence[str], config: Mapping[str, Any], started: list[ManagedProcess]
) -> RouterProc:
    """A real router process (stack.routers) with settings from a YAML file (defaults unless `config` says
    otherwise); ready when /ready answers 200."""
    port = free_port()
    settings = {"prefill": list(prefill_args), "decode": list(decode_args), **config}
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(settings))
    router = Router(router_spec(port, None, [], [], name=f"router-{port}", config=path), log_dir=LOGS)
    _launch(router, started)
    return RouterProc(router, router.url, dict(config))


def start_standin(
    role: str, name: str, behaviour: str, kv_dir: Path, started: list[ManagedProcess], **flags: object
) -> Worker:
    port = free_port()
    argv = [sys.executable, "-m", STANDIN_MODULE, "--port", str(port), "--behaviour", behaviour]
    argv += ["--engine-id", name, "--kv-dir", str(kv_dir)]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    url = f"http://{LOOPBACK}:{port}"
    log = LOGS / f"standin-{name}-{port}.log"
    spec = ProcessSpec(f"standin-{name}-{port}", tuple(argv), dict(os.environ), log, f"{url}/health", REPO)
    handle = _launch(ManagedProcess(spec), started)
    return Worker(role, name, url, handle, "standin", standin_arg(role, name, port))


def standin_arg(role: str, name: str, port: int) -> str:
    """The router's --prefill SPEC (or --decode URL) of a stand-in, spelled by the engine spec it stands in for
    (our push connector, engine id `name`, side port 5600: the identity the router hands on in a leg's body)."""
    connector = KVPUSH_CONNECTOR[0]
    spec = EngineSpec(name, "prefill", Path(STANDIN_MODULE), port, side_port=5600, connector=connector, engine_id=name)
    return spec.prefill_arg() if role == "prefill" else spec.url


@contextlib.contextmanager
def standin_bed(
    prefills: Sequence[str], decodes: Sequence[str], config: Mapping[str, Any], kv_dir: Path, **flags: object
) -> Iterator[Bed]:
    """Stand-ins with the given behaviours (the first of a role is the faulty one) behind a router."""
    started: list[ManagedProcess] = []
    try:
        p = [start_standin("prefill", f"p{i}", b, kv_dir, started, **flags) for i, b in enumerate(prefills)]
        d = [start_standin("decode", f"d{i}", b, kv_dir, started, **flags) for i, b in enumerate(decodes)]
        router = start_router([w.router_arg for w in p], [w.router_arg for w in d], config, started)
        yield Bed(router, p, d, started)
    finally:
        stop_all(started)


@contextlib.contextmanager
def vllm_bed(
    config: Mapping[str, Any],
    lease_s: float | None = None,
    kv_timeout_s: float = KV_TIMEOUT_S,
    shape: BedShape | None = None,
) -> Iterator[Bed]:
    """Two prefill engines (core 0) and one decode engine (core 1) on our push connector, behind a router; P's
    lease (`lease_s`: how long finished blocks wait for a registration) is the connector's default unless given,
    D's hold deadline `kv_timeout_s` (how long a registration waits for its KV, and quarantined blocks are kept).
    `shape` (default: both prefills plain and routed) gives prefills their own vLLM flags and keeps some of them
    out of the router (`bed.prefills` still holds every prefill: each is observed after a row)."""
    from stack.engines import Fleet
    from stack.family import pd_family, start_family
    from stack.link.plan import Shaping
    from stack.tiny_model import build

    shape = shape or BedShape()
    model = build(MODEL_DIR, "tiny")
    family = pd_family(
        shape.label,
        model,
        KVPUSH_CONNECTOR[0],
        module=KVPUSH_CONNECTOR[1],
        n_prefill=2,
        prefill_args=shape.prefill_args,
        decode_args=shape.decode_args,
        kv_events=KV_EVENT_OFFSETS if shape.kv_events else None,
        connector_extra={"kv_timeout_s": kv_timeout_s, **({} if lease_s is None else {"lease_s": lease_s})},
    )
    started: list[ManagedProcess] = []
    with contextlib.ExitStack() as stack:
        link = stack.enter_context(Link(Shaping.for_rate(LINK_RATE_BIT_S))) if shape.link else None
        fleet = stack.enter_context(Fleet(LOGS, spread_start=True))  # stops before the link closes
        engines = start_family(fleet, family, 420.0, link=link)
        try:
            p = [
                Worker("prefill", e.engine_spec.name, e.url, e, "vllm", router_prefill_arg(e.engine_spec))
                for e in engines.prefills
            ]
            d = Worker("decode", engines.decode.engine_spec.name, engines.decode.url, engines.decode, "vllm", "")
            d.router_arg = d.url
            routed = [w.router_arg for i, w in enumerate(p) if shape.routed is None or i in shape.routed]
            deadline = {} if shape.prefill_deadline is None else {"timeouts": {"prefill": shape.prefill_deadline}}
            router = start_router(routed, [d.url], {**config, **deadline, **shape.router_config}, started)
            yield Bed(router, p, [d], started, link)
        finally:
            for worker in (*p, d):
                worker.resume()
            stop_all(started)


def router_prefill_arg(spec: EngineSpec) -> str:
    """The router's --prefill SPEC of an engine of the bed: its identity, and `dp=N` with data parallelism."""
    dp = spec.dp_size
    return spec.prefill_arg() + (f",dp={dp}" if dp > 1 else "")


def stop_all(started: list[ManagedProcess]) -> None:
    while started:
        handle = started.pop()
        with contextlib.suppress(ProcessLookupError):
            if handle.pid is not None:
                os.killpg(handle.pid, signal.SIGCONT)
        handle.stop(10.0)
