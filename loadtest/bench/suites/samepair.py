"""Suite "same-pair": kvpush and vllm-router loaded at the same time in front of one real vLLM push pair.

cpu-vllm runs the fronts one after the other, so on two shared cores a point's verdict between two routers is
decided by the drift between their runs (the same front's TTFT p50 moved by up to a third between repeats),
not by the routers. Here both fronts of a pair are loaded together and take one Poisson stream at the point's
rate in turn: the stream is cut into blocks of two consecutive arrivals, a coin per block decides which front
sends which (arrivals.ArrivalSpec stride/phase), and every front sends its own prompts. So the pair sees the
point's rate, both fronts meet the same engines at the same moments, and request j of one front is paired
with request j of the other (`paired_ttft` in the rows: median TTFT difference over the pairs, share of pairs
where this front was faster). What is left between their rows is what the routers themselves add.

Pairs: the two push pairs of cpu-vllm (upstream's NixlPushConnector and ours), booted one after the other and
measured one at a time, every P pinned to core 0 and every D to core 1. A row's `qps` is the pair's load;
`front_qps` (extra) is that front's mean rate, half the point's. KV sources are read from the decode around
both fronts' load (`kv_sources: "shared"`). Needs vllm-router (.venv-vrouter, `make bench` installs it);
without it the suite refuses to run, since it has nothing to compare. Holds the machine's vLLM lock throughout.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench.fronts import Front
from loadtest.bench.point import measure_together
from loadtest.bench.procs import vllm_lock, vrouter_binary
from loadtest.bench.suites.cpu import (
    FAMILIES,
    MODEL_SIZE,
    engine_point,
    front_labels,
    pair_family,
    probe_legs,
    start_fronts,
)
from stack.engines import Fleet
from stack.family import start_family
from stack.local import StackOptions, ensure_model

PUSH_PAIRS = tuple(f.label for f in FAMILIES if f.mode == "push")


@dataclass(frozen=True)
class SamePairPlan:
    input_len: int
    output_len: int
    qps: tuple[float, ...]  # the pair's load; the two fronts take its arrivals in turn
    requests: int  # per front, point and repeat
    warmup: int
    repeats: int = 3
    max_point_s: float = 0.0  # > 0: at most (qps / 2) x this many requests per front (keeps light points short)
    pairs: tuple[str, ...] = PUSH_PAIRS
    probe_tokens: int = 1500  # cpu-vllm's startup concurrency probe

    def __post_init__(self) -> None:
        unknown = [p for p in self.pairs if p not in PUSH_PAIRS]
        if unknown or not self.pairs:
            raise ValueError(f"same-pair pairs: got {', '.join(self.pairs) or 'none'} (known: {', '.join(PUSH_PAIRS)})")
        if self.repeats < 1 or self.requests < 1:
            raise ValueError("same-pair: repeats and requests must be >= 1")

    def n_for(self, qps: float) -> int:
        if self.max_point_s <= 0:
            return self.requests
        return max(3, min(self.requests, round(qps / 2 * self.max_point_s)))


# Wall time ~ 1 min boot per pair + pairs x repeats x sum over points of (n / (qps / 2) + ~5 s):
# 2 x 3 x (120 + 40 + 27 + 20 + 15 + 25) s, about 25 minutes on 2 idle cores.
FULL = SamePairPlan(1024, 64, (1.0, 3.0, 4.5, 6.0, 8.0), requests=60, warmup=2, max_point_s=120.0)
SMOKE = SamePairPlan(256, 8, (2.0,), requests=3, warmup=0, repeats=1, pairs=("kvpush-push",))


def run(plan: SamePairPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    if vrouter_binary() is None:
        raise RuntimeError("same-pair: vllm-router not found (.venv-vrouter; `make bench` installs it)")
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=MODEL_SIZE))
    families = [f for f in FAMILIES if f.label in plan.pairs]
    with vllm_lock(), Fleet(logs) as fleet:
        pairs: list[list[tuple[Front, dict[str, Any]]]] = []
        for family in families:  # one pair at a time (suites/cpu.py run says why)
            pair = start_family(fleet, pair_family(family, model), timeout=600.0)
            started = start_fronts(fleet, family, pair.prefills[0], pair.decode, logs, vrouter=True)
            pairs.append([(f, probe_legs(f, plan.probe_tokens)) for f in started])
        for i, qps in enumerate(plan.qps):
            for rep in range(plan.repeats):
                for fronts in pairs:
                    rows += _point(fronts, plan, qps, i, rep, run_id, run_dir, summary, progress)
    return rows


def _point(
    fronts: list[tuple[Front, dict[str, Any]]],
    plan: SamePairPlan,
    qps: float,
    index: int,
    rep: int,
    run_id: str,
    run_dir: Path,
    summary: Path,
    progress: bool,
) -> list[dict[str, Any]]:
    """Every front of one pair at once, taking one arrival stream in turn, each with its own prompts."""
    salt = int(time.time() * 1000) % 1_000_000_007 or 1
    points = []
    for k, (front, probe) in enumerate(fronts):
        extra: dict[str, Any] = {"run_id": run_id, "model": MODEL_SIZE, "repeat": rep, "front_qps": qps / 2}
        extra["concurrency_probe"] = probe
        labels = front_labels("same-pair", front, qps, plan.input_len, plan.output_len)
        seed = 5000 + 100 * index + rep  # one stream per point and repeat, taken by the fronts in turn
        # distinct salts: no front hits P's prefix cache with the other's prompt
        more = {"stride": len(fronts), "phase": k, "salt": salt + 7919 * k}
        points.append(engine_point(front, labels, plan.n_for(qps), seed, plan.warmup, extra, **more))
    return measure_together(points, run_dir, summary, progress)
