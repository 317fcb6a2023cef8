"""Suite "overhead": what a front door adds, on zero-cost simulated workers (profile "zero").

Fronts, one at a time on the same fake P and D: direct to D (baseline), kvpush push, kvpush pull, and
vllm-router in P/D mode. Closed loop at each concurrency; the front door's own CPU time and peak RSS are
read from /proc for its process group.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import benchkit as kit
from loadtest.results import RowLabels
from stack.engines import Fleet
from stack.procs import ManagedProcess, free_port

PROFILE = "zero"


@dataclass(frozen=True)
class OverheadPlan:
    input_len: int
    output_len: int
    levels: tuple[tuple[int, int], ...]  # (concurrency, requests)


FULL = OverheadPlan(128, 16, ((1, 300), (64, 1500), (256, 3000)))
SMOKE = OverheadPlan(32, 4, ((1, 5), (4, 8)))


def _front_door(fleet: Fleet, name: str, proc: ManagedProcess) -> ManagedProcess:
    fleet.start(proc)
    proc.wait_healthy(timeout=60.0)
    return proc


def run(plan: OverheadPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    binary = kit.vrouter_binary()
    with Fleet(logs) as fleet:
        p_port, d_port = free_port(), free_port()
        fleet.start(kit.sim_proc("sim-zero-p", "prefill", p_port, PROFILE, "both", logs))
        fleet.start(kit.sim_proc("sim-zero-d", "decode", d_port, PROFILE, "both", logs))
        fleet.wait_all_healthy(timeout=60.0)
        p_spec = f"{kit.url(p_port)},engine_id=sim-zero-p,side_port={p_port}"
        fronts: list[tuple[str, str, str, ManagedProcess | None]] = [("direct", "direct", kit.url(d_port), None)]
        for mode in ("push", "pull"):
            port = free_port()
            proc = _front_door(
                fleet, f"router-{mode}", kit.router_proc(f"router-{mode}", port, mode, p_spec, kit.url(d_port), logs)
            )
            fronts.append(("kvpush", mode, kit.url(port), proc))
        if binary is None:
            hint = f"pip install vllm-router=={kit.VROUTER_VERSION} into .venv-vrouter"
            print(f"overhead: vllm-router not found ({hint}); its rows are skipped")
        else:
            port, prom = free_port(), free_port()
            proc = _front_door(
                fleet,
                "vllm-router",
                kit.vrouter_proc("vllm-router", port, prom, kit.url(p_port), kit.url(d_port), logs, binary),
            )
            fronts.append(("vllm-router", "pull", kit.url(port), proc))
        for conc, n in plan.levels:
            for i, (router, mode, base, front) in enumerate(fronts):
                labels = RowLabels(
                    "overhead",
                    router,
                    mode,
                    "sim",
                    None,
                    conc,
                    plan.input_len,
                    plan.output_len,
                    {"run_id": run_id, "profile": PROFILE},
                )
                point = kit.Point(
                    labels,
                    base,
                    n,
                    seed=2000 + i,
                    warmup=min(2 * conc, 200),
                    timeout_s=60.0,
                    router_timings=router == "kvpush",
                )
                rows.append(kit.measure(point, run_dir, summary, progress, cpu_pid=front.pid if front else None))
    return rows
