"""Simulator profiles: public hardware/model numbers from YAML, turned into the cost model's constants."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class Profile:
    """Effective constants the cost model uses (already multiplied by efficiencies and GPU counts).

    A rate of math.inf makes the matching time zero (the "zero" profile).
    """

    name: str
    flops_per_token: float  # dense FLOPs per processed token (2 x parameters)
    attn_flops_per_pair: float  # attention FLOPs per (query token, context token) pair
    weight_bytes: float  # bytes of weights read once per step
    kv_bytes_per_token: float  # K+V bytes per token, all layers, whole instance
    flops_per_s: float  # effective compute rate of the instance
    mem_bytes_per_s: float  # effective HBM bandwidth of the instance
    step_overhead_s: float  # per engine step: scheduling, launches, TP collectives
    max_batched_tokens: int  # chunked-prefill token budget per step
    max_seqs: int
    block_size: int  # tokens per KV block
    kv_capacity_tokens: int
    net_bytes_per_s: float  # effective network bandwidth P -> D
    descriptors_per_run: (
        int  # descriptors per run of blocks per rank: one per region (ranks move their shards in parallel)
    )
    transfer_per_descriptor_s: float  # posting cost per descriptor, on the transfer path
    setup_per_descriptor_s: float  # preparing descriptors (pull: on D's engine loop; push: P's writer thread)
    handshake_s: float  # first contact between a P and a D engine
    notify_s: float  # completion notification latency to the other side
    api_fixed_s: float  # API server per request (HTTP parse, validation), off the engine loop
    api_per_token_s: float  # API server tokenization per prompt token
    rendezvous: bool = True  # False: a remote leg's KV "lands" at once, with no side-channel round trip to P
    # the mean run of blocks consecutive on both P and D (connector/transfer/layout.block_runs: one descriptor per
    # run and region, as NIXL posts merged lists); 1.0: no two blocks adjacent, one descriptor per block and region
    blocks_per_run: float = 1.0


def _f(x: Any) -> float:
    return float(x)


def from_mapping(doc: dict[str, Any]) -> Profile:
    """Derive the constants from the YAML's raw numbers (each section documents its source)."""
    m, node, eff, eng, net, api = (doc[k] for k in ("model", "node", "efficiency", "engine", "network", "api"))
    dtype = _f(m["dtype_bytes"])
    kv_dtype = _f(m.get("kv_dtype_bytes", dtype))
    gpus = _f(node["gpus"])
    kv_per_token = 2 * _f(m["layers"]) * _f(m["kv_heads"]) * _f(m["head_dim"]) * kv_dtype
    weight_bytes = _f(m["params"]) * dtype
    hbm = gpus * _f(node["hbm_bytes_per_gpu"]) * _f(eng["gpu_memory_utilization"])
    activations = _f(eng.get("activation_reserve_bytes", 0.0))
    free = max(hbm - weight_bytes - activations, 0.0)
    capacity = int(free / kv_per_token) if kv_per_token > 0 and math.isfinite(free) else 10**9
    tp = max(int(node.get("tp", gpus)), 1)
    kv_heads_per_rank = max(int(m["kv_heads"]) // tp, 1)
    # vLLM's NIXL connector registers K and V of every layer separately: 2 x layers regions, one descriptor per run
    # of blocks and region per rank (per kv head group on that rank if heads are split across blocks).
    descs = int(2 * int(m["layers"]) * (kv_heads_per_rank if net.get("descriptor_per_head", False) else 1))
    return Profile(
        name=str(doc["name"]),
        flops_per_token=2 * _f(m["params"]) * _f(m.get("active_fraction", 1.0)),
        attn_flops_per_pair=4 * _f(m["layers"]) * _f(m["q_heads"]) * _f(m["head_dim"]),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        flops_per_s=gpus * _f(node["peak_flops_per_gpu"]) * _f(eff["mfu"]),
        mem_bytes_per_s=gpus * _f(node["mem_bw_per_gpu"]) * _f(eff["mbu"]),
        step_overhead_s=_f(eng["step_overhead_s"]),
        max_batched_tokens=int(eng["max_num_batched_tokens"]),
        max_seqs=int(eng["max_num_seqs"]),
        block_size=int(eng["block_size"]),
        kv_capacity_tokens=capacity,
        net_bytes_per_s=_f(net["link_bits_per_s"]) / 8 * _f(net["efficiency"]),
        descriptors_per_run=descs,
        transfer_per_descriptor_s=_f(net["transfer_per_descriptor_s"]),
        setup_per_descriptor_s=_f(net["setup_per_descriptor_s"]),
        handshake_s=_f(net["handshake_s"]),
        notify_s=_f(net["notify_s"]),
        api_fixed_s=_f(api["fixed_s"]),
        api_per_token_s=_f(api["per_prompt_token_s"]),
        rendezvous=bool(net.get("rendezvous", True)),
        blocks_per_run=_blocks_per_run(net.get("blocks_per_run", 1.0)),
    )


def _blocks_per_run(x: Any) -> float:
    value = float(x)
    if not value >= 1.0:  # NaN too
        raise ValueError(f"network.blocks_per_run must be >= 1 (blocks in a run), got {x!r}")
    return value


def load(name_or_path: str) -> Profile:
    """A profile by name (loadtest/sim/profiles/NAME.yaml) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile is a YAML mapping")
    return from_mapping(doc)
