"""The multiturn suite's fronts: a front is its name (plan.FRONTS, replicas.fronts) and its routers, one
`loadtest.bench.fronts.Front` each (a conversation's turns go to them in turn). kvpush routers with and without
the session-affinity decider (the decider fronts log each checked bypass at INFO: checks.py), vllm-router in push
mode with `consistent_hash` on X-Session-ID, and vllm-router's `kv_aware` (replicas.vrouter_kv_argv)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from loadtest.bench.fronts import Front
from loadtest.bench.procs import url, vrouter_binary
from loadtest.bench.suites.multiturn import replicas as replicas_mod
from loadtest.bench.suites.multiturn.plan import MultiTurnPlan, decider_yaml
from loadtest.job import REPO
from stack.engines import Engine, Fleet
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec, StartupError, free_port
from stack.routers import Router, router_spec

Routers = tuple[Front, ...]  # a started front's routers, in the order turns go to them


def is_kvpush(name: str) -> bool:
    return not name.startswith("vllm-router")


def has_decider(name: str) -> bool:
    """A kvpush front with the session-affinity decider (every kvpush front but plain "kvpush")."""
    return is_kvpush(name) and name != "kvpush"


def pids(routers: Routers) -> list[int]:
    return [r.proc.pid for r in routers if r.proc is not None and r.proc.pid]


def decider_logs(name: str, routers: Routers) -> list[Path]:
    """The decider front's routers' log files (their 'bypass checked' lines); none for another front."""
    return [r.proc.log_path for r in routers if r.proc is not None] if has_decider(name) else []


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(REPO) + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


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
        ProcessSpec("vllm-router-mt", tuple(argv), env(), logs / "vllm-router-mt.log", f"{url(port)}/health", REPO)
    )


def start(
    front: str, plan: MultiTurnPlan, fleet: Fleet, p: Engine, decodes: list[str], logs: Path, run_dir: Path, model: Path
) -> Routers | None:
    """The front's routers, started and healthy; None when its binary is missing or it did not start."""
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
        return (Front("vllm-router", "push", url(port), proc, p.url, connector=plan.connector),)
    config = None
    if has_decider(front):
        config = run_dir / f"multiturn-{front}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        events = replicas_mod.kv_events_yaml() if replicas_mod.uses_events(front) else ""
        tokenizer = model if events and plan.answer_tokenizer and front != replicas_mod.ESTIMATE else None
        config.write_text(decider_yaml(plan, block_size(p.url), tokenizer) + events, encoding="utf-8")
    level = "warning" if config is None else "info"  # a decider logs each checked bypass at INFO
    routers = []
    for i in range(replicas_mod.replicas_of(front, plan.replicas)):
        port = free_port()
        proc = fleet.start(kvpush_proc(f"router-mt-{front}-{i}", port, prefill, decodes, logs, config, level))
        proc.wait_healthy(timeout=60.0)
        routers.append(Front("kvpush", "push", url(port), proc, p.url, connector=plan.connector))
    return tuple(routers)


def _start_peer(
    front: str, plan: MultiTurnPlan, fleet: Fleet, p: Engine, decodes: list[str], logs: Path
) -> Routers | None:
    """vllm-router's kv_aware routers (replicas.vrouter_kv_argv), `replicas_of` of them."""
    binary = vrouter_binary()
    if binary is None:
        print(f"multiturn: vllm-router not found (.venv-vrouter); {front} is skipped")
        return None
    routers = []
    for i in range(replicas_mod.replicas_of(front, plan.replicas)):
        port = free_port()
        argv = replicas_mod.vrouter_kv_argv(binary, p.url, decodes, port, free_port(), block_size(p.url) or 16)
        log = logs / f"{front}-{i}.log"
        proc = fleet.start(
            ManagedProcess(ProcessSpec(f"{front}-{i}", tuple(argv), env(), log, f"{url(port)}/health", REPO))
        )
        try:
            proc.wait_healthy(timeout=120.0)
        except StartupError as error:  # the peer's flags or version: its rows are skipped, ours still run
            print(f"multiturn: {front} did not start ({error}); its rows are skipped")
            return None
        routers.append(Front("vllm-router", "push", url(port), proc, p.url, connector=plan.connector))
    return tuple(routers)
