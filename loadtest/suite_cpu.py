"""Suite "cpu-vllm": real vLLM CPU engines (tiny model) behind kvpush (push and pull) and vllm-router (pull).

One P/D pair at a time (P on core 0, D on core 1), one pair per connector family: the upstream pull pair
(NixlConnector) serves kvpush-pull and vllm-router, the upstream push pair (NixlPushConnector) and our push pair
(connector.plugin.KvpushConnector) serve kvpush-push. Holds /tmp/kvpush-vllm.lock throughout.
Every row records decode's prompt tokens by source, to show the KV arrived by transfer.
"""

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.benchkit import Point, measure, router_proc, url, vrouter_binary, vrouter_proc
from loadtest.results import RowLabels
from stack.engines import EngineSpec, Fleet
from stack.local import StackOptions, ensure_model
from stack.procs import free_port

LOCK = Path("/tmp/kvpush-vllm.lock")
MODEL_SIZE = "bench"  # 4 layers, hidden 256: a 1024-token prefill takes ~0.33 s on one core (anchors.md)


@dataclass(frozen=True)
class Family:
    """One connector on both engines of a pair, and the router mode that drives it."""

    label: str  # the rows' `connector`
    mode: str
    connector: str
    module: str | None = None


FAMILIES = (
    Family("upstream-pull", "pull", "NixlConnector"),
    Family("upstream-push", "push", "NixlPushConnector"),
    Family("kvpush-push", "push", "KvpushConnector", "connector.plugin"),
)


@dataclass(frozen=True)
class CpuPlan:
    input_len: int
    output_len: int
    points: tuple[tuple[float, int], ...]  # (qps, requests)
    warmup: int


# The stack's pinned engines prefill a 1024-token prompt in ~0.15 s (first run: TTFT ~170 ms at 0.5 QPS), so P
# saturates near 6 req/s on an idle box: 0.5 light, 1.5-4.5 loaded, 6 and 8 at and past saturation.
FULL = CpuPlan(1024, 64, ((0.5, 24), (1.5, 40), (3.0, 40), (4.5, 60), (6.0, 60), (8.0, 60)), warmup=2)
SMOKE = CpuPlan(256, 8, ((1.0, 3),), warmup=0)


@contextmanager
def vllm_lock() -> Iterator[None]:
    with LOCK.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pair_specs(family: Family, model: Path) -> tuple[EngineSpec, EngineSpec]:
    name, c, m = family.label, family.connector, family.module
    p = EngineSpec(
        name=f"vllm-{name}-p",
        role="prefill",
        model=model,
        core=0,
        connector=c,
        connector_module=m,
        engine_id=f"kvpush-bench-{name}-p",
    )
    d = EngineSpec(name=f"vllm-{name}-d", role="decode", model=model, core=1, connector=c, connector_module=m)
    return p, d


def _fronts(fleet: Fleet, mode: str, p_url: str, p_spec: str, d_url: str, logs: Path) -> list[tuple[str, str]]:
    """(router name, base URL) of every front door for this pair, started and ready."""
    out = []
    port = free_port()
    proc = fleet.start(router_proc(f"router-{mode}", port, mode, p_spec, d_url, logs))
    proc.wait_healthy(timeout=60.0)
    out.append(("kvpush", url(port)))
    binary = vrouter_binary()
    if mode == "pull" and binary is not None:
        port, prom = free_port(), free_port()
        proc = fleet.start(vrouter_proc("vllm-router", port, prom, p_url, d_url, logs, binary))
        proc.wait_healthy(timeout=120.0)
        out.append(("vllm-router", url(port)))
    elif mode == "pull":
        print("cpu-vllm: vllm-router not found (.venv-vrouter); its rows are skipped")
    return out


def run(plan: CpuPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=MODEL_SIZE))  # shared cache; built in a child process
    with vllm_lock():
        for family in FAMILIES:
            mode = family.mode
            with Fleet(logs) as fleet:
                p, d = fleet.start_all(pair_specs(family, model))
                fleet.wait_all_healthy(timeout=600.0)
                side = p.engine_spec.side_port
                p_spec = f"{p.url},engine_id={p.engine_spec.engine_id},side_port={side}"
                fronts = _fronts(fleet, mode, p.url, p_spec, d.url, logs)
                for i, (qps, n) in enumerate(plan.points):
                    for j, (router, base) in enumerate(fronts if i % 2 == 0 else fronts[::-1]):
                        labels = RowLabels(
                            "cpu-vllm",
                            router,
                            mode,
                            family.label,
                            qps,
                            None,
                            plan.input_len,
                            plan.output_len,
                            {"run_id": run_id, "model": MODEL_SIZE},
                        )
                        point = Point(
                            labels,
                            base,
                            n,
                            seed=3000 + i,
                            warmup=plan.warmup,
                            tokenizer="server",
                            tokenizer_url=p.url,
                            router_timings=router == "kvpush",
                            decode_url=d.url,
                            timeout_s=120.0,
                            extra={"order": j},
                        )
                        rows.append(measure(point, run_dir, summary, progress))
    return rows
