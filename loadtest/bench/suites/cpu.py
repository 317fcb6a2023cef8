"""Suite "cpu-vllm": real vLLM CPU engines (tiny model), three P/D pairs up at once, every front side by side.

Pairs (every P pinned to core 0, every D to core 1, as the stack pins them): the upstream pull pair
(NixlConnector), the upstream push pair (NixlPushConnector) and our push pair (connector.plugin.KvpushConnector).
Fronts: kvpush and vllm-router 0.1.17 on every pair (vllm-router in push mode on both push pairs: it learns push
from the prefill's first answer stating `transfer_mode: push`; a probe at startup checks on the engines that it
then sends D's leg while P is still prefilling, `concurrency_probe` in the rows). So a row differs from its
neighbour either by connector (same front) or by front (same pair).

Every QPS point runs `repeats` times; even repeats take the fronts in one order, odd repeats in the reverse
order, so drift on these shared cores shows up as spread between repeats, not as a difference between fronts.
`pairs` picks which pairs boot (all three by default; `--set pairs=kvpush-push` runs one). Candidates for our
connector's defaults boot only when named: `kvpush-step` (`push_granularity: step`, the default until
2026-12-07, when layer-wise won: connector/README.md) and `kvpush-thread` (`progress: thread`), each our
connector on its own pair, so they run beside the product default in one run. Run 20261207T191606Z's
`kvpush-layer` rows were the layer-wise candidate, when `kvpush-push` was step-wise.
Holds the machine's vLLM lock throughout (procs.vllm_lock). Every row records decode's prompt tokens by
source, to show the KV arrived by transfer.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench.fronts import Front
from loadtest.bench.point import Point, measure
from loadtest.bench.probes import concurrency_probe
from loadtest.bench.procs import router_proc, url, vllm_lock, vrouter_binary, vrouter_proc
from loadtest.results import RowLabels
from stack.engines import Engine, Fleet
from stack.family import PdFamily, pd_family, start_family
from stack.local import StackOptions, ensure_model
from stack.procs import free_port

MODEL_SIZE = "bench"  # 4 layers, hidden 256: a 1024-token prefill takes ~0.33 s on one core (anchors.md)


@dataclass(frozen=True)
class Family:
    """One connector on both engines of a pair, and the router mode that drives it."""

    label: str  # the rows' `connector`
    mode: str
    connector: str
    module: str | None = None
    extra: tuple[tuple[str, str], ...] = ()  # kv_connector_extra_config beyond the product default (a candidate)


FAMILIES = (
    Family("upstream-pull", "pull", "NixlConnector"),
    Family("upstream-push", "push", "NixlPushConnector"),
    Family("kvpush-push", "push", "KvpushConnector", "connector.plugin"),
)
# Candidates for our connector's defaults (issue 43 item 4): off unless `pairs` names them, each its own pair.
CANDIDATES = (
    Family("kvpush-step", "push", "KvpushConnector", "connector.plugin", (("push_granularity", "step"),)),
    Family("kvpush-thread", "push", "KvpushConnector", "connector.plugin", (("progress", "thread"),)),
)
DEFAULT_PAIRS = tuple(f.label for f in FAMILIES)


@dataclass(frozen=True)
class CpuPlan:
    input_len: int
    output_len: int
    qps: tuple[float, ...]
    requests: int  # per point and front
    warmup: int
    repeats: int = 2  # >= 2: the second takes the fronts in reverse order
    vrouter: bool = True  # vllm-router fronts, when its binary is found
    probe_tokens: int = 1500  # the concurrency probe's prompt (< the engines' 2048-token context)
    max_point_s: float = 0.0  # > 0: at most qps x this many requests at a point (keeps light points short)
    pairs: tuple[str, ...] = DEFAULT_PAIRS  # which pairs boot (`--set pairs=kvpush-push`; candidates by name)

    def __post_init__(self) -> None:
        known = [f.label for f in (*FAMILIES, *CANDIDATES)]
        unknown = [p for p in self.pairs if p not in known]
        if unknown:
            raise ValueError(f"cpu-vllm pairs: unknown {', '.join(unknown)} (known: {', '.join(known)})")
        if not self.pairs:
            raise ValueError(f"cpu-vllm pairs: none given (known: {', '.join(known)})")

    @property
    def families(self) -> tuple[Family, ...]:
        """The plan's pairs, in FAMILIES order, then the candidates it names."""
        return tuple(f for f in (*FAMILIES, *CANDIDATES) if f.label in self.pairs)

    def n_for(self, qps: float) -> int:
        if self.max_point_s <= 0:
            return self.requests
        return max(3, min(self.requests, math.ceil(qps * self.max_point_s)))


# The stack's pinned engines prefill a 1024-token prompt in ~0.15 s, so P saturates near 6 req/s on an idle box.
# Wall time ~ 2 min boot (six engines) + fronts x repeats x sum over points of (n / qps + ~2 s): here
# 6 x 2 x ~113 s, about 25 minutes on 2 idle cores. The lead's 20-minute run is in bench/README.md.
FULL = CpuPlan(1024, 64, (0.5, 1.5, 3.0, 4.5, 6.0, 8.0), requests=40, warmup=2, max_point_s=40.0)
SMOKE = CpuPlan(256, 8, (1.0,), requests=3, warmup=0)


def pair_family(family: Family, model: Path) -> PdFamily:
    """One prefill (core 0, engine id `vllm-{label}-p0`) and one decode (core 1) on the family's connector."""
    extra = dict(family.extra) or None
    return pd_family(f"vllm-{family.label}", model, family.connector, module=family.module, connector_extra=extra)


def start_fronts(fleet: Fleet, family: Family, p: Engine, d: Engine, logs: Path, vrouter: bool) -> list[Front]:
    """kvpush and (when found) vllm-router in front of one pair, started and ready."""
    mode, tag = family.mode, family.label
    port = free_port()
    proc = fleet.start(router_proc(f"router-{tag}", port, mode, p.engine_spec.prefill_arg(), d.url, logs))
    proc.wait_healthy(timeout=60.0)
    out = [Front("kvpush", mode, url(port), proc, p.url, d.url, family.label)]
    binary = vrouter_binary() if vrouter else None
    if binary is not None:
        port, prom = free_port(), free_port()
        proc = fleet.start(vrouter_proc(f"vllm-router-{tag}", port, prom, p.url, d.url, logs, binary))
        proc.wait_healthy(timeout=120.0)
        out.append(Front("vllm-router", mode, url(port), proc, p.url, d.url, family.label))
    elif vrouter:
        print("cpu-vllm: vllm-router not found (.venv-vrouter); its rows are skipped")
    return out


def run(plan: CpuPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=MODEL_SIZE))  # shared cache; built in a child process
    with vllm_lock(), Fleet(logs) as fleet:
        engines: dict[str, tuple[Engine, Engine]] = {}
        for family in plan.families:
            # one pair at a time: a pair's ports are picked only once the previous pair has bound all of its own
            # (six engines started at once let vLLM's internal ZMQ ports take an HTTP port picked for another)
            pair = start_family(fleet, pair_family(family, model), timeout=600.0)
            engines[family.label] = (pair.prefills[0], pair.decode)
        fronts = [f for fam in plan.families for f in start_fronts(fleet, fam, *engines[fam.label], logs, plan.vrouter)]
        probes = {(f.router, f.connector): probe_legs(f, plan.probe_tokens) for f in fronts if f.mode == "push"}
        for i, qps in enumerate(plan.qps):
            for rep in range(plan.repeats):
                order = fronts if rep % 2 == 0 else fronts[::-1]
                for j, front in enumerate(order):
                    probe = probes.get((front.router, front.connector))
                    rows.append(_point(front, plan, qps, i, rep, j, probe, run_id, run_dir, summary, progress))
    return rows


def probe_legs(front: Front, prompt_tokens: int) -> dict[str, Any]:
    """The startup concurrency probe of a push front (probes.concurrency_probe), printed and returned."""
    if front.p_url is None or front.d_url is None:
        raise ValueError(f"cpu-vllm: {front.router} has no pair behind it to probe")
    result = concurrency_probe(front.base, front.p_url, front.d_url, prompt_tokens=prompt_tokens)
    state = "concurrent" if result.get("concurrent") else "NOT concurrent"
    print(f"cpu-vllm: {front.router} on {front.connector}: legs {state} ({result})")
    return result


def _point(
    front: Front,
    plan: CpuPlan,
    qps: float,
    index: int,
    rep: int,
    order: int,
    probe: dict[str, Any] | None,
    run_id: str,
    run_dir: Path,
    summary: Path,
    progress: bool,
) -> dict[str, Any]:
    extra: dict[str, Any] = {"run_id": run_id, "model": MODEL_SIZE, "repeat": rep, "order": order}
    if probe is not None:
        extra["concurrency_probe"] = probe
    labels = front_labels("cpu-vllm", front, qps, plan.input_len, plan.output_len)
    # the same arrivals for every front and repeat of a point
    point = engine_point(front, labels, plan.n_for(qps), 3000 + index, plan.warmup, extra)
    return measure(point, run_dir, summary, progress)


def front_labels(suite: str, front: Front, qps: float, input_len: int, output_len: int) -> RowLabels:
    return RowLabels(suite, front.router, front.mode, front.connector, qps, None, input_len, output_len)


def engine_point(
    front: Front, labels: RowLabels, n: int, seed: int, warmup: int, extra: dict[str, Any], **more: Any
) -> Point:
    """A point sent through `front` to its real engines: P's tokenizer, decode's KV sources, kvpush's timings."""
    return Point(
        labels,
        front.base,
        n,
        seed=seed,
        warmup=warmup,
        tokenizer="server",
        tokenizer_url=front.p_url,
        router_timings=front.router == "kvpush",
        decode_url=front.d_url,
        writer_url=front.p_url if front.connector.startswith("kvpush") else None,
        timeout_s=120.0,
        extra=extra,
        **more,
    )
