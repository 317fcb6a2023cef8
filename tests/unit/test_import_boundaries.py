"""Pure modules stay pure: importing one loads none of the heavy or I/O libraries (checked in a fresh process).

Every module of router/ and connector/ is pure unless it is named below as one that does I/O, so a new module
is checked from the day it is added. A pure module that fails to import fails here; nothing is skipped. Across
router/, only router/app.py may load fastapi or starlette, directly or through what it imports.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = (
    "fastapi",
    "starlette",
    "httpx",
    "aiohttp",
    "uvicorn",
    "granian",
    "prometheus_client",
    "vllm",
    "nixl",
    "torch",
    "dns",
)
WEB = {"fastapi", "starlette"}
# The modules whose job is I/O (HTTP serving and calls, metrics, processes, sockets, threads, the engine).
# A new module is pure unless it is added here, with the reason it cannot be.
IO = {
    "router.__main__": "entry point",
    "router.cli": "entry point: starts the server",
    "router.app": "the HTTP layer (fastapi)",
    "router.service": "wires the running router",
    "router.dispatch": "sends both legs",
    "router.answer": "relays upstream streams",
    "router.upstream": "upstream HTTP calls",
    "router.retokenize": "asks decode workers to tokenize answers (upstream HTTP calls)",
    "router.transport": "the aiohttp-backed transport",
    "router.http1": "the legs' HTTP/1.1 client (sockets, httptools, httpx errors)",
    "router.http1_pool": "the legs' connection pool: opens sockets",
    "router.scrape": "reads the workers' /metrics",
    "router.pool": "health probes and gauges",
    "router.admission": "the admission gauges",
    "router.metrics": "prometheus_client",
    "router.drain": "the server's SIGTERM drain (uvicorn)",
    "router.serve_granian": "the server's SIGTERM drain (granian)",
    "router.signals": "sets the process's SIGTERM/SIGINT handlers",
    "router.discovery.build": "builds the discovery sources",
    "router.discovery.dns": "DNS queries",
    "router.discovery.kubernetes": "the Kubernetes API",
    "connector.plugin": "vLLM's connector base",
    "connector.worker": "vLLM's connector base",
    "connector.stats": "vLLM's stats base",
    "connector.transfer": "NIXL",
    "connector.transfer_thread": "the transfer thread",
    "connector.handshake": "the side-channel sockets",
    "connector.memory_backend": "an in-memory transfer backend with a lock",
    "connector.gpu_check": "a command: spawns two processes that run NIXL transfers",
}
# The rendezvous state machine also stays out of threads and sockets (the transfer thread drives it). Others may
# load threading through the standard logging module.
EXTRA = {"connector.rendezvous": ("threading", "socket")}


def modules_of(package: str) -> list[str]:
    """Every module of a package, from its files (nothing is imported to list them)."""
    root = REPO / package
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


ROUTER = modules_of("router")
PURE = [m for m in (*ROUTER, *modules_of("connector")) if m not in IO]


@functools.cache
def loaded_after_import(module: str) -> frozenset[str]:
    """Top-level names in sys.modules after importing `module` alone in a fresh interpreter."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    if done.returncode != 0:
        pytest.fail(f"`import {module}` fails:\n{done.stderr[-3000:]}")
    return frozenset(name.split(".")[0] for name in json.loads(done.stdout))


def test_the_lists_name_real_modules() -> None:
    assert {"router.health", "router.auth", "router.decider", "connector.metadata", "connector.layout"} <= set(PURE)
    assert {"router.policy", "router.config", "router.discovery.settings", "router.discovery.pods"} <= set(PURE)
    assert "connector.scheduler" in PURE  # the scheduler half is vLLM-free: it runs in the unit tests
    stale = {m for m in IO if not (REPO / Path(*m.split("."))).with_suffix(".py").exists()}
    assert not stale, f"IO names modules that do not exist: {sorted(stale)}"


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_nothing_heavy(module: str) -> None:
    banned = {*HEAVY, *EXTRA.get(module, ())} & loaded_after_import(module)
    assert not banned, f"{module} pulls in {sorted(banned)}: keep it pure, or add it to IO with the reason"


@pytest.mark.parametrize("module", [m for m in ROUTER if m != "router.app"])
def test_only_app_loads_fastapi_or_starlette(module: str) -> None:
    web = WEB & loaded_after_import(module)
    assert not web, f"{module} loads {sorted(web)}: only router/app.py may"
