"""Real vLLM CPU engines as child processes: the typed spec, its exact command and environment, handles, fleets.

An `EngineSpec` says what one engine is (role, ports, core, KV connector); `prefill_arg()` is the router's
`--prefill` SPEC naming a prefill engine's NIXL identity (`stack.family` builds whole P/D families). The pure
functions `engine_argv()`,
`kv_transfer_config()` and `vllm_env()` turn a spec into the command line and environment that work on a
small CPU box (see docs in stack/site/sitecustomize.py for the two harness switches). `Engine` runs one spec
as a `ManagedProcess` pinned to its core with taskset; `Fleet` starts several at once and stops every
process it started when its `with` block ends, however it ends.

Spread start (`Fleet(spread_start=True)`): an engine starts on every core this process may use and every thread of
its process group is pinned to its own core the moment it answers /health (`Engine.poll_ready`), before anyone
can send it work. Starting is some 30 s of imports in each of its three processes; two prefills pinned to one
core start one after the other, spread they use the idle core too. vLLM's own thread moves are kept on the
engine's core all along (KVPUSH_KEEP_AFFINITY_CORES) and its compute threads are bound to it
(VLLM_CPU_OMP_THREADS_BIND), so a started engine runs exactly as a pinned one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

from stack.link.plan import Place
from stack.procs import (
    LOOPBACK,
    ManagedProcess,
    ProcessSpec,
    Readiness,
    free_port,
    http_status,
    pin_group,
    port_is_free,
)

__all__ = [
    "DEFAULT_LOG_DIR",
    "REPO_ROOT",
    "Engine",
    "EngineSpec",
    "Fleet",
    "engine_argv",
    "free_port",
    "kv_transfer_config",
    "resolve_ports",
    "vllm_env",
]

Role = Literal["prefill", "decode", "single"]
_Process = TypeVar("_Process", bound=ManagedProcess)
KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SITE_DIR = REPO_ROOT / "stack" / "site"
DEFAULT_LOG_DIR = REPO_ROOT / ".cache" / "kvpush" / "logs"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_DEFAULT_KV_ROLE: Mapping[Role, KvRole] = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "single": "kv_both",
}
# Flags engine_argv() sets itself; repeating one in extra_args would leave two competing values.
MANAGED_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--enforce-eager",
        "--dtype",
        "--max-model-len",
        "--kv-transfer-config",
        "--kv-events-config",
    }
)
# Where an engine with KV events on publishes: its HTTP port plus these offsets (publisher, replay socket), each
# data-parallel rank one port further; the router is told the same offsets (--kv-events-port-offset,
# --kv-events-replay-offset), so several engines share a host.
KV_EVENT_OFFSETS = (1000, 2000)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One vLLM instance. Port 0 means "pick a free port when the Engine is made" (see resolve_ports).

    Without a connector the engine is a plain server (no kv-transfer-config, no side channel). With one,
    kv_role defaults from the role (prefill: kv_producer, decode: kv_consumer, single: kv_both) and a
    side-channel port is always set (None is treated like 0).
    """

    name: str
    role: Role
    model: Path
    http_port: int = 0
    core: int = 0
    side_port: int | None = None
    connector: str | None = None
    connector_module: str | None = None
    engine_id: str | None = None
    kv_role: KvRole | None = None
    connector_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    served_model_name: str = "tiny"
    max_model_len: int = 2048
    place: Place | None = None  # on an emulated link (stack.link): its namespace, address and NIC
    kv_events: tuple[int, int] | None = None  # publish KV events on the HTTP port + (offset, replay offset)

    def __post_init__(self) -> None:
        problems = spec_problems(self)
        if problems:
            raise ValueError(f"invalid engine spec {self.name!r}: " + "; ".join(problems))

    @property
    def effective_kv_role(self) -> KvRole | None:
        if self.connector is None:
            return None
        return self.kv_role or _DEFAULT_KV_ROLE[self.role]

    @property
    def host(self) -> str:
        """The address the engine listens on: loopback, or its own address on the link."""
        return self.place.address if self.place else LOOPBACK

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def dp_size(self) -> int:
        """The engine's data-parallel ranks: `--data-parallel-size N` in its extra args (1 without it)."""
        return _flag_int(self.extra_args, "--data-parallel-size")

    @property
    def tp_size(self) -> int:
        """The engine's tensor-parallel ranks: `--tensor-parallel-size N` in its extra args (1 without it)."""
        return _flag_int(self.extra_args, "--tensor-parallel-size")

    @property
    def cpu_ranks(self) -> int:
        """The worker ranks vLLM CPU binds OpenMP for, one CPU list each: every (DP, TP) rank of the engine."""
        return self.dp_size * self.tp_size

    def kv_event_ports(self) -> list[int]:
        """The ports its KV-event publishers and replay sockets bind (every rank); none when events are off."""
        if self.kv_events is None or self.http_port == 0:
            return []
        return [self.http_port + offset + rank for offset in self.kv_events for rank in range(self.dp_size)]

    def kv_events_config(self) -> dict[str, Any] | None:
        """The --kv-events-config object (rank 0's ports; vLLM offsets the others by their rank), or None."""
        if self.kv_events is None:
            return None
        offset, replay = self.kv_events
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.http_port + offset}",
            "replay_endpoint": f"tcp://*:{self.http_port + replay}",
            "topic": "",
        }

    def prefill_arg(self) -> str:
        """The router's `--prefill` SPEC for this engine: its URL and, with a connector, its NIXL identity
        (`URL,engine_id=...,side_port=...`, and `,tp=N` at TP > 1: a push decode leg leaves before prefill's
        answer states its TP). Without an engine id the router learns the identity itself."""
        if self.http_port == 0:
            raise ValueError(f"{self.name}: resolve ports before naming the engine to the router")
        if self.connector is None or self.engine_id is None or not self.side_port:
            return self.url
        return prefill_arg(self.url, self.engine_id, self.side_port, self.tp_size)


def prefill_arg(url: str, engine_id: str, side_port: int, tp_size: int = 1) -> str:
    """The router's `--prefill` SPEC of a push prefill at `url` with this NIXL identity, for stand-ins and
    simulators too (an engine of ours says it with `EngineSpec.prefill_arg`)."""
    tp = f",tp={tp_size}" if tp_size > 1 else ""
    return f"{url},engine_id={engine_id},side_port={side_port}{tp}"


def spec_problems(spec: EngineSpec) -> list[str]:
    """Everything wrong with a spec, as sentences (empty when it is valid)."""
    found = []
    if not _NAME.fullmatch(spec.name):
        found.append("name must be letters, digits, '_', '.', '-' (it names the log file)")
    if spec.role not in get_args(Role):
        found.append(f"role must be one of {get_args(Role)}")
    for label, port in (("http_port", spec.http_port), ("side_port", spec.side_port)):
        if port is not None and not 0 <= port <= 65535:
            found.append(f"{label} {port} is not a TCP port")
    if spec.core < 0:
        found.append("core must be >= 0")
    if spec.max_model_len <= 0:
        found.append("max_model_len must be positive")
    if not spec.served_model_name:
        found.append("served_model_name must not be empty")
    found.extend(_connector_problems(spec))
    clashes = sorted({a.split("=", 1)[0] for a in spec.extra_args} & MANAGED_FLAGS)
    if clashes:
        found.append(f"extra_args repeat flags the launcher sets: {', '.join(clashes)}")
    return found


def _connector_problems(spec: EngineSpec) -> list[str]:
    if spec.connector is None:
        given = [
            label
            for label, value in (
                ("connector_module", spec.connector_module),
                ("engine_id", spec.engine_id),
                ("kv_role", spec.kv_role),
                ("connector_extra", spec.connector_extra or None),
            )
            if value is not None
        ]
        return [f"{', '.join(given)} need a connector"] if given else []
    found = []
    if spec.kv_role is not None and spec.kv_role not in get_args(KvRole):
        found.append(f"kv_role must be one of {get_args(KvRole)}")
    wrong = {"prefill": "kv_consumer", "decode": "kv_producer"}.get(spec.role)
    if spec.kv_role is not None and spec.kv_role == wrong:
        found.append(f"a {spec.role} engine cannot be {wrong}")
    return found


def resolve_ports(
    spec: EngineSpec, pick: Callable[[], int] = free_port, is_free: Callable[[int], bool] = port_is_free
) -> EngineSpec:
    """The spec with every port that is 0 (or a connector's missing side port) replaced by pick(); with KV events
    on, a picked HTTP port is one whose event ports are free too (a few tries)."""
    http_port = spec.http_port or pick()
    for _ in range(20):
        if spec.http_port or spec.kv_events is None:
            break
        if all(0 < p <= 65535 and is_free(p) for p in dataclasses.replace(spec, http_port=http_port).kv_event_ports()):
            break
        http_port = pick()
    side_port = spec.side_port
    if spec.connector is not None and not side_port:
        side_port = pick()
    return dataclasses.replace(spec, http_port=http_port, side_port=side_port)


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """The --kv-transfer-config object for the spec, or None for an engine without a connector."""
    if spec.connector is None:
        return None
    config: dict[str, Any] = {
        "kv_connector": spec.connector,
        "kv_role": spec.effective_kv_role,
        "kv_buffer_device": "cpu",
    }
    if spec.connector_module is not None:
        config["kv_connector_module_path"] = spec.connector_module
    if spec.engine_id is not None:
        config["engine_id"] = spec.engine_id
    if spec.connector_extra:
        config["kv_connector_extra_config"] = dict(spec.connector_extra)
    return config


def _flag_int(args: Sequence[str], flag: str) -> int:
    """The integer value of `flag` (`FLAG N` or `FLAG=N`) in vLLM's args, 1 without it."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith(f"{flag}="):
            return int(arg.split("=", 1)[1])
    return 1


def engine_argv(
    spec: EngineSpec, python: str = sys.executable, start_cores: Sequence[int] | None = None
) -> tuple[str, ...]:
    """The exact command for a spec whose ports are resolved: the whole instance pinned with taskset to its core,
    or to `start_cores` for a spread start (and, on a link, started inside its namespace)."""
    if spec.http_port == 0:
        raise ValueError(f"{spec.name}: resolve ports before building the command")
    argv = [
        *(spec.place.argv_prefix() if spec.place else ()),
        "taskset",
        "-c",
        ",".join(str(c) for c in sorted(start_cores)) if start_cores else str(spec.core),
        python,
        "-m",
        API_SERVER_MODULE,
        "--model",
        str(spec.model),
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.http_port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(spec.max_model_len),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: what the decider checks
    ]
    config = kv_transfer_config(spec)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    events = spec.kv_events_config()
    if events is not None:
        argv += ["--kv-events-config", json.dumps(events, sort_keys=True, separators=(",", ":"))]
    return (*argv, *spec.extra_args)


def vllm_env(
    *,
    core: int,
    side_port: int | None,
    repo_root: Path = REPO_ROOT,
    base: Mapping[str, str] | None = None,
    ranks: int = 1,
) -> dict[str, str]:
    """Environment for a vLLM process on this box: base (default os.environ) plus the stack's settings.

    Offline, loopback only, 1 GiB of KV cache, OpenMP bound to `core` (one list per worker rank: DP x TP), the
    NIXL side channel on side_port, and PYTHONPATH set to the harness (stack/site) and the repository (replacing
    any inherited value) with both harness switches on (threads kept on `core`).
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_HOST_IP": LOOPBACK,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
            "UCX_NET_DEVICES": "lo",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # vLLM CPU binds OpenMP per worker rank (data- and tensor-parallel): one CPU list per rank ("0|0"),
            # else every rank but the first fails to start ("CPU id list [] doesn't match local world size 1").
            # Every rank of an engine shares its core: a TP=2 engine is one engine's worth of cores here.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join([str(core)] * ranks),
            "PYTHONPATH": f"{repo_root / 'stack' / 'site'}{os.pathsep}{repo_root}",
            "KVPUSH_NIXL_NO_PROG_THREAD": "1",
            "KVPUSH_KEEP_AFFINITY": "1",
            "KVPUSH_KEEP_AFFINITY_CORES": str(core),
        }
    )
    if side_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    else:
        env.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)
    return env


def process_spec(
    spec: EngineSpec,
    log_dir: Path,
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    start_cores: Sequence[int] | None = None,
) -> ProcessSpec:
    """The ManagedProcess description of a resolved engine spec (ready when GET /health is 200); on a link the
    environment is the link's (UCX over TCP on the engine's NIC, its own address: stack.link.plan.engine_env)."""
    env = vllm_env(core=spec.core, side_port=spec.side_port, base=base_env, ranks=spec.cpu_ranks)
    return ProcessSpec(
        name=spec.name,
        argv=engine_argv(spec, python, start_cores),
        env=spec.place.env(env) if spec.place else env,
        log_path=log_dir / f"{spec.name}.log",
        ready_url=f"{spec.url}/health",
        cwd=REPO_ROOT,
    )


class Engine(ManagedProcess):
    """A vLLM instance: ports are resolved when the handle is made, so url is known before start(). With
    `spread_start` it starts on every core this process may use and is pinned to its core once ready."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        log_dir: Path = DEFAULT_LOG_DIR,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
        pick_port: Callable[[], int] = free_port,
        probe: Callable[[str], int | None] = http_status,
        spread_start: bool = False,
    ) -> None:
        self.engine_spec = resolve_ports(spec, pick_port)
        start_cores = sorted(os.sched_getaffinity(0)) if spread_start else None
        self._pinned = not spread_start
        super().__init__(process_spec(self.engine_spec, log_dir, python, base_env, start_cores), probe=probe)

    @property
    def url(self) -> str:
        return self.engine_spec.url

    def poll_ready(self, deadline: float) -> Readiness:
        """One readiness check; a spread engine is pinned to its core when it is first seen ready."""
        verdict = super().poll_ready(deadline)
        if verdict is Readiness.READY and not self._pinned:
            assert self.pid is not None
            pin_group(self.pid, self.engine_spec.core)
            self._pinned = True
        return verdict


class Fleet:
    """Processes started together and stopped together; use as a context manager.

    start_all() launches every engine before waiting for any, so they boot in parallel (with `spread_start` on
    every core, each pinned to its own once ready: see the module docstring); wait_all_healthy() shares one
    deadline and fails fast on the first child that dies.
    """

    def __init__(
        self,
        log_dir: Path = DEFAULT_LOG_DIR,
        *,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
        stop_grace: float = 15.0,
        spread_start: bool = False,
    ) -> None:
        self.log_dir = log_dir
        self._python = python
        self._base_env = base_env
        self._stop_grace = stop_grace
        self._spread_start = spread_start
        self.members: list[ManagedProcess] = []

    def start_all(self, specs: Sequence[EngineSpec]) -> list[Engine]:
        """Start one Engine per spec (names must be unique); returns their handles in order."""
        names = [s.name for s in specs] + [m.name for m in self.members]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        spread = self._spread_start
        engines = [
            Engine(s, log_dir=self.log_dir, python=self._python, base_env=self._base_env, spread_start=spread)
            for s in specs
        ]
        for engine in engines:
            self.start(engine)
        return engines

    def start(self, process: _Process) -> _Process:
        """Start any managed process (the router, a stand-in) under this fleet's stop guarantee."""
        self.members.append(process)
        process.start()
        return process

    def wait_all_healthy(self, timeout: float, interval: float = 0.5) -> None:
        """Wait until every member is ready; raise the StartupError of the first one that fails."""
        deadline = time.monotonic() + timeout
        pending = list(self.members)
        while pending:
            for member in list(pending):
                verdict = member.poll_ready(deadline)
                if verdict is Readiness.READY:
                    pending.remove(member)
                elif verdict is not Readiness.WAIT:
                    raise member.startup_error(verdict)
            if pending:
                time.sleep(interval)

    def exited(self) -> list[ManagedProcess]:
        """Members whose main process has exited."""
        return [m for m in self.members if m.exit_code() is not None]

    def stop_all(self) -> None:
        """SIGTERM every group at once, then stop each (newest first); every member is attempted."""
        for member in self.members:
            member.terminate()
        failures: list[BaseException] = []
        for member in reversed(self.members):
            try:
                member.stop(self._stop_grace)
            except (OSError, subprocess.SubprocessError) as exc:  # keep stopping the others, report after
                failures.append(exc)
        if failures:
            raise RuntimeError(f"could not stop every process cleanly: {failures}") from failures[0]

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
