"""The GPU check's configuration and the rounds it runs (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("P", "D")
NOTICE = "kvpush-gpu-check"


@dataclass(frozen=True)
class CheckConfig:
    device: str = "cuda"  # P's device; "cpu" = DRAM
    d_device: str = ""  # D's device ("" = same as P's)
    layout: str = "LBHNC"
    layers: int = 32
    blocks: int = 4096
    heads: int = 8
    tokens: int = 16  # tokens per block
    head_size: int = 128
    dtype: str = "bfloat16"
    write_blocks: int = 1024  # blocks of the bulk round (1024 x 16 = a 16k-token prompt)
    reps: int = 5
    deadline_s: float = 270.0
    backends: tuple[str, ...] = ("UCX",)
    seed: int = 7
    corrupt: bool = False  # flip one byte of one written block on D before hashing (proves the check fails)
    p_tp: int = 1  # prefill ranks (one process each): > 1 or d_tp > 1 runs the TP check (tp.py)
    d_tp: int = 1  # decode ranks
    alloc: str = "cudamalloc"  # the KV cache's memory: "cudamalloc" (vLLM 0.32) or "vmm" (0.34's extensible cache)
    vmm_chunks: int = 1  # vmm: physical allocations (cuMemCreate) mapped into the one address range
    vmm_storages: str = "whole"  # vmm: "whole" (one storage, one NIXL registration) or "layer" (one per layer)
    vmm_rdma: str = "auto"  # vmm: the chunks' gpuDirectRDMACapable flag: auto (when the device supports it), on, off

    @property
    def decode_device(self) -> str:
        return self.d_device or self.device


CPU_DEFAULTS: dict[str, Any] = {"layers": 4, "blocks": 64, "heads": 2, "head_size": 64, "write_blocks": 16, "reps": 3}


def plan_rounds(cfg: CheckConfig) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, P block ids, D block ids)`` per round; D ids never repeat across rounds."""
    import random

    rng = random.Random(cfg.seed)
    n = cfg.write_blocks
    bulk = (tuple(range(n)), tuple(range(cfg.blocks - n, cfg.blocks)))
    free = list(range(cfg.blocks - n))
    rng.shuffle(free)
    k = max(1, min(n, len(free) // 3))
    scattered = (tuple(rng.sample(range(cfg.blocks), k)), tuple(free[:k]))
    hit = max(1, k // 2)  # D already holds a prefix: it registers fewer blocks than P sends
    prefix = (tuple(rng.sample(range(cfg.blocks), k)), tuple(free[k : k + hit]))
    return [("bulk", *bulk), ("scattered", *scattered), ("prefix-hit", *prefix)]
