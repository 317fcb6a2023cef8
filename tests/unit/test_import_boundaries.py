"""Pure modules stay pure: importing one loads none of the heavy or I/O libraries (checked in a fresh process).

Every module of router/ and connector/ is pure unless it is named below as one that does I/O, so a new module
is checked from the day it is added. A pure module that fails to import fails here; nothing is skipped. Across
router/, only router/app.py may load fastapi or starlette, directly or through what it imports. The router is
a leaf among our packages: importing any of its modules loads nothing of loadtest/, stack/ or connector/ (the
umbrella `kvpush` command in kvpush/cli.py imports those when chosen). Inside router/ the imports make no cycle,
counting lazy (in a function) and type-only (under TYPE_CHECKING) imports too: read from the source with ast.
"""

from __future__ import annotations

import ast
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
    "prometheus_client",
    "vllm",
    "nixl",
    "torch",
    "dns",
    "zmq",
)
WEB = {"fastapi", "starlette"}
OURS_ABOVE_ROUTER = {"loadtest", "stack", "connector", "kvpush"}  # the router imports none of these
# The modules whose job is I/O (HTTP serving and calls, metrics, processes, sockets, threads, the engine).
# A new module is pure unless it is added here, with the reason it cannot be.
IO = {
    "router.__main__": "entry point",
    "router.cli": "entry point: starts the server",
    "router.app": "the HTTP layer (fastapi)",
    "router.service": "wires the running router",
    "router.dispatch": "sends both legs",
    "router.legtasks": "a push attempt's leg tasks (the answers they relay)",
    "router.legcalls": "runs each leg to its worker (upstream HTTP calls)",
    "router.fanout": "a batched request's prompts sent at once (the dispatcher, their answers)",
    "router.passthrough": "vLLM's helper endpoints passed to a worker (upstream HTTP calls)",
    "router.feedback": "the decider's answer checks (upstream HTTP calls, router/retokenize.py)",
    "router.finish": "counts each request's end (prometheus_client)",
    "router.answer": "relays upstream streams",
    "router.upstream": "upstream HTTP calls",
    "router.retokenize": "asks decode workers to tokenize answers (upstream HTTP calls)",
    "router.aiohttp_transport": "the httpx transport over aiohttp (probes, scrapes, /v1/models)",
    "router.legs.httpx": "legs over an httpx client",
    "router.legs.http1": "the legs' HTTP/1.1 client (sockets, httptools, httpx errors)",
    "router.legs.http1_pool": "the legs' connection pool: opens sockets",
    "router.workers.scrape": "reads the workers' /metrics",
    "router.workers.pool": "health probes and gauges",
    "router.admission": "the admission gauges",
    "router.metrics": "prometheus_client",
    "router.tracing.provider": "the OpenTelemetry SDK's exporter thread; builds the OTLP exporters",
    "router.tracing.grpc_export": "the OTLP/gRPC exporter (grpc)",
    "router.drain": "the server's SIGTERM drain (uvicorn)",
    "router.signals": "sets the process's SIGTERM/SIGINT handlers",
    "router.discovery.build": "builds the discovery sources",
    "router.discovery.dns": "DNS queries",
    "router.discovery.kubernetes": "the Kubernetes API",
    "router.kv_events.subscriber": "ZMQ sockets to the engines' KV-event publishers",
    "connector.plugin": "vLLM's connector base",
    "connector.worker": "vLLM's connector base",
    "connector.stats": "vLLM's stats base",
    "connector.transfer.nixl": "NIXL",
    "connector.transfer_thread": "the transfer thread",
    "connector.wire.side_channel": "the side-channel sockets",
    "connector.transfer.memory": "an in-memory transfer backend with a lock",
}
# The rendezvous state machine also stays out of threads and sockets (the transfer thread drives it). Others may
# load threading through the standard logging module.
EXTRA = {"connector.rendezvous.prefill": ("threading", "socket")}


# Cycles inside router/ still to cut: none left (issue 19 cut decider <-> deciders and http1 <-> http1_pool).
KNOWN_CYCLES: list[list[str]] = []


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
    assert {"router.workers.health", "router.auth", "router.decider"} <= set(PURE)
    assert {"connector.wire.metadata", "connector.transfer.layout"} <= set(PURE)
    assert {"router.policy", "router.config", "router.discovery.settings", "router.discovery.pods"} <= set(PURE)
    assert {"router.legs.base", "router.deciders.registry", "router.deciders.session_affinity"} <= set(PURE)
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


@pytest.mark.parametrize("module", ROUTER)
def test_router_loads_none_of_our_other_packages(module: str) -> None:
    ours = OURS_ABOVE_ROUTER & loaded_after_import(module)
    assert not ours, f"{module} loads {sorted(ours)}: the router is a leaf (the `kvpush` umbrella is kvpush/cli.py)"


def imported_modules(module: str, known: frozenset[str]) -> set[str]:
    """Modules of `known` that `module`'s source imports anywhere: at the top, in a function, under TYPE_CHECKING.

    `from a import b` counts as importing a.b when that is a module, else a."""
    path = REPO / Path(*module.split("."))
    source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    package = module if path.is_dir() else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return (found & known) - {module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_cycles_finds_a_planted_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_router_has_no_import_cycles() -> None:
    known = frozenset(ROUTER)
    graph = {module: imported_modules(module, known) for module in ROUTER}
    assert graph["router.service"], "the import reader found no imports: it is broken"
    assert cycles(graph) == KNOWN_CYCLES, "an import cycle inside router/: cut it (a Protocol seam, a lower home)"
