"""The GPU check for a TP pair (``python -m loadtest.micro.gpu_check --p-tp N --d-tp M``): every rank a process.

Each of the ``p_tp`` prefill and ``d_tp`` decode ranks is its own process (``peer.Peer``) whose
KV cache holds only its heads of ``--heads`` (``connector.parallel.topology.heads_of``: split by rank, one
replicated head per rank where tp > heads), LBHNC, so a head is a byte range of a block. The legs are
``connector.parallel.topology.plan``'s:
each P rank loads every D rank it writes as a peer with that leg's slices (``NixlBackend.add_peer(slices=)``),
each D rank loads its source P ranks for notices only. Per round (the same three as the single pair: bulk,
scattered, prefix-hit) every P rank WRITEs each of its legs and every D rank waits for the notice of each of its
sources; then, per leg, the SHA-256 of P's source byte ranges of each block (all layers) must equal D's
destination ranges, and every block of every D rank nobody wrote must still be zero. The result has the single
pair's shape (``rounds``, ``peers`` keyed ``P0``, ``D1``..., ``failures``), plus ``legs``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import asdict
from typing import Any

from connector.parallel.topology import Leg, Topology, plan
from connector.transfer.layout import pair_blocks
from loadtest.micro.gpu_check.config import CheckConfig, plan_rounds
from loadtest.micro.gpu_check.peer import CheckError, Remote, environment

__all__ = ["check_topology", "run_tp_check"]


def check_topology(cfg: CheckConfig, head_bytes: int) -> Topology:
    """The legs of this pair (raises ``connector.parallel.topology.TopologyError`` for a split the heads do
    not allow)."""
    return plan(p_tp=cfg.p_tp, d_tp=cfg.d_tp, num_kv_heads=cfg.heads, head_bytes=head_bytes, num_layers=cfg.layers)


def run_tp_check(cfg: CheckConfig) -> dict[str, Any]:
    """Run the TP check; ``ok`` and every figure, as ``check.run_check``'s result."""
    started = time.monotonic()
    deadline = started + cfg.deadline_s
    result: dict[str, Any] = {"ok": False, "config": asdict(cfg), "environment": environment(), "failures": []}
    ctx = mp.get_context("spawn")
    p = [Remote(ctx, "P", cfg, deadline, r) for r in range(cfg.p_tp)]
    d = [Remote(ctx, "D", cfg, deadline, r) for r in range(cfg.d_tp)]
    try:
        _run(cfg, p, d, result)
    except CheckError as exc:
        result["failures"].append(str(exc))
        result["error"] = True
    finally:
        for remote in (*p, *d):
            remote.stop()
        result["wall_s"] = round(time.monotonic() - started, 3)
    result["ok"] = not result["failures"]
    return result


def _src(leg: Leg) -> list[tuple[int, int]]:
    return [(s.src, s.length) for s in leg.slices]


def _dst(leg: Leg) -> list[tuple[int, int]]:
    return [(s.dst, s.length) for s in leg.slices]


def _connect(p: list[Remote], d: list[Remote], result: dict[str, Any]) -> tuple[Topology, dict[int, str]]:
    """Every rank started, hashes agreed, each leg's peers loaded; the topology and each D rank's agent name."""
    info = {r.role: r.recv() for r in (*p, *d)}
    result["peers"] = {role: {k: v for k, v in i.items() if k != "payload"} for role, i in info.items()}
    hashes = {i["compat_hash"] for i in info.values()}
    if len(hashes) != 1:
        raise CheckError(f"compatibility hashes differ across ranks: {sorted(hashes)}")
    head_bytes = {i["head_bytes"] for i in info.values()}
    if len(head_bytes) != 1:
        raise CheckError(f"bytes per head differ across ranks: {sorted(head_bytes)}")
    cfg = CheckConfig(**result["config"])
    topology = check_topology(cfg, head_bytes.pop())
    result["legs"] = [
        {"p": leg.src.tp, "d": leg.dst, "slices": [list(map(int, (s.src, s.dst, s.length))) for s in leg.slices]}
        for leg in topology.legs
    ]
    for leg in topology.legs:  # P loads the D rank it writes (this leg's slices), D its source for notices only
        slices = [(s.src, s.dst, s.length) for s in leg.slices]
        p[leg.src.tp].call("add_peer", info[d[leg.dst].role]["payload"], None if leg.whole_blocks else slices)
        d[leg.dst].call("add_peer", info[p[leg.src.tp].role]["payload"], None, False)
    return topology, {r: str(json.loads(info[remote.role]["payload"])["agent_name"]) for r, remote in enumerate(d)}


def _run(cfg: CheckConfig, p: list[Remote], d: list[Remote], result: dict[str, Any]) -> None:
    topology, agents = _connect(p, d, result)
    written: dict[int, set[int]] = {r: set() for r in range(cfg.d_tp)}  # D rank -> block ids written
    result["rounds"] = []
    for name, src, dst in plan_rounds(cfg):
        reps = cfg.reps if name == "bulk" else 1
        left = max(1.0, p[0].deadline - time.monotonic())
        for r, remote in enumerate(d):
            remote.send("await_notice", [f"{name}.p{s.tp}" for s in topology.sources(r)], reps, left)
        row = _write_round(name, src, dst, reps, left, topology, agents, p, d, result)
        result["rounds"].append(row)
        if row["state"] == "DONE":
            src_paired, dst_paired = pair_blocks(src, dst)
            _verify(row, topology, list(src_paired), list(dst_paired), p, d, result)
            for r in range(cfg.d_tp):
                written[r].update(dst_paired)
    result["untouched_nonzero_bytes"] = sum(d[r].call("nonzero_outside", sorted(written[r])) for r in written)
    if result["untouched_nonzero_bytes"]:
        result["failures"].append(f"{result['untouched_nonzero_bytes']} bytes written outside the WRITEs' blocks")


def _write_round(
    name: str,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    reps: int,
    left: float,
    topology: Topology,
    agents: dict[int, str],
    p: list[Remote],
    d: list[Remote],
    result: dict[str, Any],
) -> dict[str, Any]:
    """Every P rank WRITEs its legs (ranks in parallel, a rank's legs one after another); D ranks' notices."""
    by_rank: dict[int, list[Leg]] = {}
    for leg in topology.legs:
        by_rank.setdefault(leg.src.tp, []).append(leg)
    wrote: list[dict[str, Any]] = []
    for i in range(max(len(legs) for legs in by_rank.values())):
        sent = [(rank, legs[i]) for rank, legs in sorted(by_rank.items()) if i < len(legs)]
        for rank, leg in sent:
            p[rank].send("write", agents[leg.dst], list(src), list(dst), f"{name}.p{rank}", reps, left)
        wrote += [p[rank].recv() for rank, _ in sent]
    notices = [remote.recv() for remote in d]
    _, dst_paired = pair_blocks(src, dst)
    row: dict[str, Any] = {"name": name, "blocks": len(dst_paired), "legs": len(topology.legs)}
    row["state"] = "DONE" if all(w["state"] == "DONE" for w in wrote) else "ERR"
    row["notice_s"] = [n["seconds"] for n in notices]
    if row["state"] != "DONE" or any(n["seconds"] is None for n in notices):
        states = sorted({w["state"] for w in wrote})
        result["failures"].append(f"round {name}: WRITE states {states}, notices {[n['seen'] for n in notices]}")
        row["state"] = "ERR"
        return row
    row["write_s"] = [round(max(w["seconds"][k] for w in wrote), 6) for k in range(reps)]  # the slowest leg
    row["bytes"] = sum(w["bytes"] for w in wrote)
    row["descriptors"] = sum(w["descriptors"] for w in wrote)
    best = min(row["write_s"])
    row["gbps_best"] = round(row["bytes"] / best / 1e9, 3) if best else None
    row["gbps_median"] = row["gbps_best"]
    return row


def _verify(
    row: dict[str, Any],
    topology: Topology,
    src: list[int],
    dst: list[int],
    p: list[Remote],
    d: list[Remote],
    result: dict[str, Any],
) -> None:
    """Per leg: SHA-256 of P's source ranges of each block == D's destination ranges (every layer)."""
    verified, bad = 0, []
    if result["config"]["corrupt"] and row["name"] == "bulk":
        d[0].call("corrupt", dst[len(dst) // 2])
    for leg in topology.legs:
        want = p[leg.src.tp].call("slice_hashes", src, _src(leg))
        got = d[leg.dst].call("slice_hashes", dst, _dst(leg))
        mismatched = [b for b, w, g in zip(dst, want, got, strict=True) if w != g]
        verified += len(dst) - len(mismatched)
        bad += [f"D{leg.dst}:{b}" for b in mismatched]
    row |= {"verified": verified, "slices": len(dst) * len(topology.legs), "mismatched": bad[:16]}
    row["blocks"] = len(dst)
    if bad:
        result["failures"].append(f"round {row['name']}: {len(bad)} leg blocks differ on D: {bad[:8]}")
