"""Suite "seed-sim": the published push-vs-pull setup (1P+1D, 16k prompts) on the a-priori simulator profile.

Four stacks run side by side, each behind its own kvpush router: pull (P states transfer_mode pull) and three
push stacks that differ only in when P posts its WRITE (writes.WriteAt): `upstream-push` (vLLM's
NixlPushConnector: one P step late), `kvpush-push` (in the completing step), `kvpush-progressive` (per chunked
prefill step). At every QPS point all stacks get the same arrival seed; their order rotates. The full run
also calibrates (loadtest/sim/calibrate.py, virtual time): calibration.json next to summary.json, and the
calibrated profile next to the a-priori one.
"""

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench.point import Point, measure
from loadtest.bench.procs import router_proc, sim_proc, url
from loadtest.job import REPO
from loadtest.results import RowLabels
from loadtest.sim import calibrate
from loadtest.sim.profile import PROFILE_DIR
from loadtest.sim.writes import CONNECTOR_WRITE_AT
from stack.engines import Fleet, prefill_arg
from stack.procs import free_port

PROFILE = "qwen3-32b-h200"


@dataclass(frozen=True)
class SeedPlan:
    input_len: int
    output_len: int
    qps: tuple[float, ...]
    warmup: int
    per_point_s: float  # requests per point = qps x this, clamped to [n_min, n_max]
    n_min: int
    n_max: int
    stacks: tuple[str, ...] = ("pull", *CONNECTOR_WRITE_AT)  # "pull" and connector labels of writes.py
    calibrate: bool = True

    def n_for(self, qps: float) -> int:
        return max(self.n_min, min(self.n_max, math.ceil(qps * self.per_point_s)))


# 16k prompts and 256 output tokens (the published output length is not stated; 256 is our assumption).
# The a-priori profile prefills a 16k prompt in ~0.35 s, so P saturates near 2.9 req/s: 3, 4 and 8 are past it.
FULL = SeedPlan(16384, 256, (0.5, 1.0, 2.0, 2.5, 3.0, 4.0, 8.0), warmup=2, per_point_s=30.0, n_min=40, n_max=120)
SMOKE = SeedPlan(2048, 8, (1.0, 2.0), warmup=0, per_point_s=2.0, n_min=3, n_max=4, calibrate=False)


def _labels(stack: str) -> tuple[str, str]:
    """(mode, connector) of a stack's rows."""
    return ("pull", "sim") if stack == "pull" else ("push", stack)


def run(
    plan: SeedPlan, run_dir: Path, summary: Path, progress: bool, run_id: str, profile: str = PROFILE
) -> list[dict[str, Any]]:
    """Every stack on `profile` (the a-priori one unless a what-if is asked for), every QPS point."""
    if plan.calibrate and profile == PROFILE:
        # the calibrated profile lands next to the a-priori one only for the repo's own results
        home = summary.parent.resolve() == (REPO / "bench" / "results").resolve()
        data = calibrate.write_files(
            calibrate.CalibrationPlan(), summary.parent, profile_dir=PROFILE_DIR if home else summary.parent
        )
        print(f"seed-sim: calibrated {data['fitted']} (pull error {data['error']:.4f})")
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    with Fleet(logs) as fleet:
        routers: dict[str, str] = {}
        decodes: dict[str, str] = {}
        prefills: dict[str, str] = {}
        for stack in plan.stacks:
            mode, _ = _labels(stack)
            write_at = None if stack == "pull" else CONNECTOR_WRITE_AT[stack].value
            p_port, d_port, r_port = free_port(), free_port(), free_port()
            fleet.start(sim_proc(f"sim-{stack}-p", "prefill", p_port, profile, mode, logs, write_at))
            fleet.start(sim_proc(f"sim-{stack}-d", "decode", d_port, profile, mode, logs))
            spec = prefill_arg(url(p_port), f"sim-{stack}-p", p_port)
            fleet.start(router_proc(f"router-{stack}", r_port, mode, spec, url(d_port), logs))
            routers[stack], decodes[stack], prefills[stack] = url(r_port), url(d_port), url(p_port)
        fleet.wait_all_healthy(timeout=60.0)
        k = len(plan.stacks)
        for i, qps in enumerate(plan.qps):
            order = [plan.stacks[(i + j) % k] for j in range(k)]
            for j, stack in enumerate(order):
                mode, connector = _labels(stack)
                extra = {"run_id": run_id, "profile": Path(profile).stem, "stack": stack, "order": j}
                labels = RowLabels(
                    "seed-sim", "kvpush", mode, connector, qps, None, plan.input_len, plan.output_len, extra
                )
                point = Point(
                    labels,
                    routers[stack],
                    plan.n_for(qps),
                    seed=1000 + i,
                    warmup=plan.warmup,
                    router_timings=True,
                    decode_url=decodes[stack],
                    prefill_url=prefills[stack],
                )
                rows.append(measure(point, run_dir, summary, progress))
    return rows


def stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
