"""GPU check: two processes, vLLM-shaped KV caches, block WRITEs through ``connector.transfer.nixl``'s NIXL
backend, SHA-256 of every written block, timings. ``python -m loadtest.micro.gpu_check --help``.

What it does, in order (each step bounded by ``--deadline``, default 270 s):

1. spawns a prefill (P) and a decode (D) process; each allocates its KV cache the way vLLM 0.32 does
   (one zeroed ``int8`` backing buffer on ``--device``, one ``[B, H, N, C]`` view per layer in
   ``--layout``), describes it with ``connector.kvcache`` (memory type VRAM/DRAM from the tensors'
   device) and builds a ``connector.transfer.nixl.NixlBackend`` over it; P fills its cache with random bytes;
2. exchanges handshake payloads (agent metadata and layout) through the parent, checks both sides'
   compatibility hashes agree, and loads each other as peers;
3. runs three WRITE rounds P -> D: ``bulk`` (one long prompt, contiguous blocks, timed ``--reps``
   times), ``scattered`` (random block ids on both sides), ``prefix-hit`` (D registers fewer blocks
   than P sends: the tails are paired, as the connector does); D waits for each WRITE's notice;
4. compares the SHA-256 of every written block (all layers of that block id) on D with P's source
   block, and checks that every block D was not sent is still all zeros.

Prints a summary, writes ``--json`` if given, and exits 0 when every block verified, 1 when a block
mismatched or a WRITE failed, 2 when the check could not run (no CUDA, no NIXL, a process died).
``--device cpu`` runs the same program on DRAM (tests/integration/loadtest/micro/test_gpu_check_cpu.py),
so it cannot rot while no GPU is at hand. Needs torch, numpy and NIXL; no vLLM, no network.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, replace
from typing import Any

from connector.transfer.layout import pair_blocks
from loadtest.micro.gpu_check.config import CPU_DEFAULTS, ROLES, CheckConfig, plan_rounds
from loadtest.micro.gpu_check.peer import CheckError, Remote, environment, failed_stage
from loadtest.micro.gpu_check.tp import run_tp_check
from loadtest.micro.gpu_check.vmm import RDMA_CHOICES

VMM_CHUNKS = 8  # `--alloc vmm`'s second variant: physical chunks behind the one range


def parse_args(argv: list[str] | None = None) -> tuple[CheckConfig, str | None]:
    """The check's configuration and the ``--json`` path (None: print only)."""
    p = argparse.ArgumentParser(prog="python -m loadtest.micro.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="P's device: cuda, cuda:N or cpu (DRAM, small defaults)")
    p.add_argument("--d-device", default="", help="D's device (default: P's)")
    p.add_argument("--layout", default="LBHNC", choices=("LBHNC", "LBNHC"))
    for name in ("layers", "blocks", "heads", "tokens", "head-size", "write-blocks", "reps", "seed"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--deadline", type=float, default=270.0, help="seconds for the whole check")
    p.add_argument("--backends", default="UCX", help="comma-separated NIXL backends")
    p.add_argument("--corrupt", action="store_true", help="flip a byte on D after the WRITE (must fail)")
    p.add_argument("--p-tp", type=int, default=1, help="prefill TP ranks, one process each (--heads split by rank)")
    p.add_argument("--d-tp", type=int, default=1, help="decode TP ranks, one process each")
    p.add_argument("--json", default=None, help="write the result here")
    _vmm_arguments(p)
    a = p.parse_args(argv)
    cfg = CheckConfig(
        device=a.device,
        d_device=a.d_device,
        layout=a.layout,
        dtype=a.dtype,
        deadline_s=a.deadline,
        backends=tuple(b for b in a.backends.split(",") if b),
        corrupt=a.corrupt,
        p_tp=a.p_tp,
        d_tp=a.d_tp,
        alloc=a.alloc,
        vmm_chunks=a.vmm_chunks,
        vmm_storages=a.vmm_storages,
        vmm_rdma=a.vmm_rdma,
    )
    if cfg.alloc == "vmm" and not all(d.startswith("cuda") for d in (cfg.device, cfg.decode_device)):
        p.error("--alloc vmm needs CUDA devices on both sides (CUDA virtual memory)")
    if cfg.vmm_chunks < 1:
        p.error("--vmm-chunks must be >= 1")
    if a.device == "cpu":
        cfg = replace(cfg, **CPU_DEFAULTS)
    sizes = ("layers", "blocks", "heads", "tokens", "head_size", "write_blocks", "reps", "seed")
    cfg = replace(cfg, **{k: getattr(a, k) for k in sizes if getattr(a, k) is not None})
    if not 0 < cfg.write_blocks <= cfg.blocks // 2:
        p.error(f"--write-blocks must be in 1..{cfg.blocks // 2} (half the cache: P and D blocks must differ)")
    if cfg.p_tp < 1 or cfg.d_tp < 1:
        p.error("--p-tp and --d-tp must be >= 1")
    if (cfg.p_tp > 1 or cfg.d_tp > 1) and cfg.layout != "LBHNC":
        p.error("--p-tp/--d-tp need --layout LBHNC (a rank's heads are byte ranges of a block only there)")
    from connector.parallel.topology import TopologyError, plan

    try:
        plan(p_tp=cfg.p_tp, d_tp=cfg.d_tp, num_kv_heads=cfg.heads, head_bytes=1, num_layers=cfg.layers)
    except TopologyError as exc:
        p.error(str(exc))
    return cfg, a.json


def _vmm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--alloc",
        default="cudamalloc",
        choices=("cudamalloc", "vmm"),
        help="the KV cache's memory: one cudaMalloc'd buffer (vLLM 0.32), or CUDA virtual memory as vLLM 0.34's "
        "extensible KV cache allocates it: the check then runs twice, the range backed by one physical chunk, then "
        "by --vmm-chunks of them",
    )
    p.add_argument("--vmm-chunks", type=int, default=VMM_CHUNKS, help="vmm: the second run's physical chunks")
    p.add_argument(
        "--vmm-storages",
        default="whole",
        choices=("whole", "layer"),
        help="vmm: one NIXL registration over the whole range, or one per layer (the views vLLM 0.34 hands over)",
    )
    p.add_argument("--vmm-rdma", default="auto", choices=RDMA_CHOICES, help="vmm: the chunks' GPUDirect RDMA flag")


def vmm_variants(cfg: CheckConfig) -> list[CheckConfig]:
    """``--alloc vmm``: the range backed by one physical chunk, then by ``vmm_chunks`` (once if that is 1)."""
    counts = dict.fromkeys((1, cfg.vmm_chunks))
    return [replace(cfg, vmm_chunks=n) for n in counts]


def run_vmm(cfg: CheckConfig) -> dict[str, Any]:
    """Each VMM variant's whole check, one after the other; ``ok`` when every one passed."""
    started = time.monotonic()
    variants = [run(v) for v in vmm_variants(cfg)]
    return {
        "ok": all(v["ok"] for v in variants),
        "alloc": "vmm",
        "config": asdict(cfg),
        "environment": environment(),
        "variants": variants,
        "failures": [
            f"{n} chunk(s): {f}" for n, v in zip(counts(variants), variants, strict=True) for f in v["failures"]
        ],
        "error": any(v.get("error") for v in variants),
        "wall_s": round(time.monotonic() - started, 3),
    }


def counts(variants: list[dict[str, Any]]) -> list[int]:
    return [int(v["config"]["vmm_chunks"]) for v in variants]


VERDICTS = {
    None: "registered, every WRITE done and every block verified",
    "start": "the peer process did not start",
    "alloc": "the VMM allocation failed",
    "describe": "the KV cache could not be described",
    "register": "NIXL registration failed",
    "ready": "the peer failed after registering",
    "write": "a WRITE or its notice failed",
    "verify": "blocks differ on D",
}


def vmm_summary(result: dict[str, Any]) -> str:
    """One verdict line per VMM variant, then each variant's own summary."""
    cfg = result["config"]
    lines = [
        f"kvpush GPU check, VMM ({cfg['vmm_storages']} storages, RDMA flag {cfg['vmm_rdma']}): "
        f"{'PASS' if result['ok'] else 'FAIL'} in {result['wall_s']} s"
    ]
    for n, variant in zip(counts(result["variants"]), result["variants"], strict=True):
        stage = failed_stage(variant)
        spans = {p.get("registrations_spanning_chunks") for p in variant.get("peers", {}).values()} - {None}
        across = f", registrations across chunks: {max(spans)}" if spans else ""
        lines.append(f"  {n} physical chunk(s): {VERDICTS.get(stage, stage or '')}{across}")
    for variant in result["variants"]:
        lines += ["", summary(variant)]
    return "\n".join(lines)


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """Run the whole check; the result says ``ok`` and every figure (see the module docstring)."""
    started = time.monotonic()
    deadline = started + cfg.deadline_s
    result: dict[str, Any] = {"ok": False, "config": asdict(cfg), "environment": environment(), "failures": []}
    ctx = mp.get_context("spawn")
    remotes = {role: Remote(ctx, role, cfg, deadline) for role in ROLES}
    try:
        _run_rounds(cfg, remotes, result)
    except CheckError as exc:
        result["failures"].append(str(exc))
        result["error"] = True
    finally:
        for remote in remotes.values():
            remote.stop()
        result["wall_s"] = round(time.monotonic() - started, 3)
    result["ok"] = not result["failures"]
    return result


def _run_rounds(cfg: CheckConfig, remotes: dict[str, Remote], result: dict[str, Any]) -> None:
    p, d = remotes["P"], remotes["D"]
    info = {role: r.recv() for role, r in remotes.items()}
    result["peers"] = {role: {k: v for k, v in i.items() if k != "payload"} for role, i in info.items()}
    if info["P"]["compat_hash"] != info["D"]["compat_hash"]:
        raise CheckError(f"compatibility hashes differ: {info['P']['compat_hash']} != {info['D']['compat_hash']}")
    result["add_peer_s"] = {
        "P": p.call("add_peer", info["D"]["payload"]),
        "D": d.call("add_peer", info["P"]["payload"]),
    }
    d_agent = json.loads(info["D"]["payload"])["agent_name"]
    expected: dict[int, str] = {}  # D block -> SHA-256 it must hold
    result["rounds"] = []
    for name, src, dst in plan_rounds(cfg):
        reps = cfg.reps if name == "bulk" else 1
        left = max(1.0, d.deadline - time.monotonic())
        d.send("await_notice", name, reps, left)
        p.send("write", d_agent, list(src), list(dst), name, reps, left)
        wrote, notice = p.recv(), d.recv()
        src_paired, dst_paired = pair_blocks(src, dst)
        row: dict[str, Any] = {"name": name, "blocks": len(dst_paired), "state": wrote["state"]}
        row["write_s"] = [round(s, 6) for s in wrote["seconds"]]
        row["notice_s"] = notice["seconds"]
        if wrote["state"] != "DONE" or notice["seconds"] is None:
            result["failures"].append(f"round {name}: WRITE {wrote['state']}, notices seen {notice['seen']}/{reps}")
            result["rounds"].append(row)
            continue
        best = min(wrote["seconds"])
        row |= {"bytes": wrote["bytes"], "descriptors": wrote["descriptors"]}
        row["gbps_best"] = round(wrote["bytes"] / best / 1e9, 3)
        row["gbps_median"] = round(wrote["bytes"] / statistics.median(wrote["seconds"]) / 1e9, 3)
        if cfg.corrupt and name == "bulk":
            d.call("corrupt", dst_paired[len(dst_paired) // 2])
        want = p.call("hashes", list(src_paired))
        got = d.call("hashes", list(dst_paired))
        bad = [b for b, w, g in zip(dst_paired, want, got, strict=True) if w != g]
        expected.update(zip(dst_paired, want, strict=True))
        row |= {"verified": len(dst_paired) - len(bad), "mismatched": bad[:16]}
        if bad:
            result["failures"].append(f"round {name}: {len(bad)} of {len(dst_paired)} blocks differ on D: {bad[:8]}")
        result["rounds"].append(row)
    final = d.call("hashes", sorted(expected))
    stale = [b for b, h in zip(sorted(expected), final, strict=True) if h != expected[b]]
    result["final_mismatched"] = stale[:16]
    if stale and not cfg.corrupt:
        result["failures"].append(f"{len(stale)} written blocks changed after their round: {stale[:8]}")
    result["untouched_nonzero_bytes"] = d.call("nonzero_outside", sorted(expected))
    if result["untouched_nonzero_bytes"]:
        result["failures"].append(f"{result['untouched_nonzero_bytes']} bytes written outside the WRITEs' blocks")


def summary(result: dict[str, Any]) -> str:
    """Human-readable lines for the terminal (the JSON has everything)."""
    lines = [f"kvpush GPU check: {'PASS' if result['ok'] else 'FAIL'} in {result.get('wall_s', '?')} s"]
    env = result["environment"]
    lines.append("  " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "nixl-cu13", "nixl-cu12") if k in env))
    for role, peer in result.get("peers", {}).items():
        t = peer["timings"]
        lines.append(
            f"  {role}: {peer['mem_type']} {peer['device']} ({peer['device_name']}), {peer['layout']}, "
            f"{peer['regions']} regions in {peer['storages']} storage(s), "
            f"{peer['registrations']} NIXL registration(s), "
            f"{peer['descriptors']} descriptors; alloc {t['alloc_s']:.2f} s, backend {t['backend_s']:.3f} s"
        )
    for row in result.get("rounds", []):
        if "bytes" in row:
            lines.append(
                f"  {row['name']}: {row['blocks']} blocks, {row['bytes'] / 2**20:.1f} MiB, {row['descriptors']} "
                f"descriptors, WRITE best {min(row['write_s']) * 1e3:.2f} ms ({row['gbps_best']} GB/s, median "
                f"{row['gbps_median']} GB/s), SHA-256 verified {row['verified']}/{row.get('slices', row['blocks'])}"
            )
        else:
            lines.append(f"  {row['name']}: WRITE {row['state']}")
    if "untouched_nonzero_bytes" in result:
        lines.append(f"  untouched blocks on D: {result['untouched_nonzero_bytes']} non-zero bytes")
    lines += [f"  FAILURE: {f}" for f in result["failures"]]
    return "\n".join(lines)


def run(cfg: CheckConfig) -> dict[str, Any]:
    """One check: the single pair, or the TP pair when either side has ranks."""
    return run_tp_check(cfg) if cfg.p_tp > 1 or cfg.d_tp > 1 else run_check(cfg)


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    if cfg.alloc == "vmm":
        result = run_vmm(cfg)
        print(vmm_summary(result), flush=True)
    else:
        result = run(cfg)
        print(summary(result), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if result["ok"]:
        return 0
    return 2 if result.get("error") else 1


if __name__ == "__main__":
    raise SystemExit(main())
