"""GPU check: two processes, vLLM-shaped KV caches, block WRITEs through ``connector.transfer``'s NIXL
backend, SHA-256 of every written block, timings. ``python -m connector.gpu_check --help``.

What it does, in order (each step bounded by ``--deadline``, default 270 s):

1. spawns a prefill (P) and a decode (D) process; each allocates its KV cache the way vLLM 0.32 does
   (one zeroed ``int8`` backing buffer on ``--device``, one ``[B, H, N, C]`` view per layer in
   ``--layout``), describes it with ``connector.kvcache`` (memory type VRAM/DRAM from the tensors'
   device) and builds a ``connector.transfer.NixlBackend`` over it; P fills its cache with random bytes;
2. exchanges handshake payloads (agent metadata and layout) through the parent, checks both sides'
   compatibility hashes agree, and loads each other as peers;
3. runs three WRITE rounds P -> D: ``bulk`` (one long prompt, contiguous blocks, timed ``--reps``
   times), ``scattered`` (random block ids on both sides), ``prefix-hit`` (D registers fewer blocks
   than P sends: the tails are paired, as the connector does); D waits for each WRITE's notice;
4. compares the SHA-256 of every written block (all layers of that block id) on D with P's source
   block, and checks that every block D was not sent is still all zeros.

Prints a summary, writes ``--json`` if given, and exits 0 when every block verified, 1 when a block
mismatched or a WRITE failed, 2 when the check could not run (no CUDA, no NIXL, a process died).
``--device cpu`` runs the same program on DRAM (tests/integration/connector/test_gpu_check_cpu.py),
so it cannot rot while no GPU is at hand. Needs torch, numpy and NIXL; no vLLM, no network.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, replace
from importlib import metadata as importlib_metadata
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from connector.layout import num_descriptors, pair_blocks

if TYPE_CHECKING:
    import torch

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
    p_tp: int = 1  # prefill ranks (one process each): > 1 or d_tp > 1 runs connector.gpu_check_tp
    d_tp: int = 1  # decode ranks

    @property
    def decode_device(self) -> str:
        return self.d_device or self.device


CPU_DEFAULTS: dict[str, Any] = {"layers": 4, "blocks": 64, "heads": 2, "head_size": 64, "write_blocks": 16, "reps": 3}


def parse_args(argv: list[str] | None = None) -> tuple[CheckConfig, str | None]:
    """The check's configuration and the ``--json`` path (None: print only)."""
    p = argparse.ArgumentParser(prog="python -m connector.gpu_check", description=__doc__.split("\n\n")[0])
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
    )
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
    from connector.topology import TopologyError, plan

    try:
        plan(p_tp=cfg.p_tp, d_tp=cfg.d_tp, num_kv_heads=cfg.heads, head_bytes=1, num_layers=cfg.layers)
    except TopologyError as exc:
        p.error(str(exc))
    return cfg, a.json


# --------------------------------------------------------------------------------------------
# The KV cache as vLLM 0.32 allocates it
# --------------------------------------------------------------------------------------------


def vllm_like_caches(cfg: CheckConfig, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One zeroed ``int8`` buffer and one ``[B, H, N, C]`` view per layer, layer-compact, in
    ``cfg.layout`` (LBHNC: head-major block interior; LBNHC: token-major). C = K and V of one head."""
    import torch

    dtype = getattr(torch, cfg.dtype)
    elt = torch.empty(0, dtype=dtype).element_size()
    content = 2 * cfg.head_size
    page = cfg.heads * cfg.tokens * content  # elements
    raw = torch.zeros(page * elt * cfg.blocks * cfg.layers, dtype=torch.int8, device=device)
    typed = raw.view(dtype)
    if cfg.layout == "LBHNC":
        strides = (page, cfg.tokens * content, content, 1)
    else:  # LBNHC
        strides = (page, content, cfg.heads * content, 1)
    shape = (cfg.blocks, cfg.heads, cfg.tokens, content)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            typed, shape, strides, storage_offset=i * page * cfg.blocks
        )
        for i in range(cfg.layers)
    }
    return caches, raw


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


# --------------------------------------------------------------------------------------------
# One peer process
# --------------------------------------------------------------------------------------------


class _Peer:
    """P or D inside its process: the cache, its description, the NIXL backend. Under TP, TP rank ``rank`` of
    its side: its cache holds only that rank's heads (``connector.topology.heads_of``), P's bytes seeded per rank."""

    def __init__(self, role: str, cfg: CheckConfig, rank: int = 0) -> None:
        import torch

        from connector.kvcache import describe_kv_caches
        from connector.topology import heads_of
        from connector.transfer import NixlBackend

        self.role, self.rank = role, rank
        self.total_heads = cfg.heads
        tp = cfg.p_tp if role == "P" else cfg.d_tp
        self.cfg = cfg = replace(cfg, heads=len(heads_of(rank, tp, cfg.heads)), seed=cfg.seed + rank)
        self.device = cfg.device if role == "P" else cfg.decode_device
        self.torch = torch
        self.timings: dict[str, float] = {}
        t = time.perf_counter()
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {self.device}: torch {torch.__version__} sees no CUDA GPU")
            index = torch.device(self.device).index
            torch.cuda.set_device(0 if index is None else index)
            self.device = f"cuda:{torch.cuda.current_device()}"
        caches, self.raw = vllm_like_caches(cfg, self.device)
        if role == "P":
            gen = torch.Generator(device=self.raw.device).manual_seed(cfg.seed)
            self.raw.random_(-128, 128, generator=gen)
        self._sync()
        self.timings["alloc_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.kv = describe_kv_caches(caches, num_blocks=cfg.blocks, kv_buffer_device=self.device.split(":")[0])
        self.layout = self.kv.layout(cfg.tokens)
        self.timings["describe_s"] = time.perf_counter() - t
        self.pages = [  # per layer: [blocks, block_len] bytes over the backing buffer
            self.raw[off : off + r.block_len * r.num_blocks].view(r.num_blocks, r.block_len)
            for (_, off), r in zip(self.kv.region_offsets, self.kv.regions, strict=True)
        ]
        t = time.perf_counter()
        name = f"kvpush-gpucheck-{role}{rank}-{os.getpid()}"
        self.backend = NixlBackend(name, self.layout, cfg.backends, registrations=self.kv.registrations())
        self.registrations = len(self.kv.storages)  # one per backing storage, not one per layer
        self.timings["backend_s"] = time.perf_counter() - t

    def _sync(self) -> None:
        if self.raw.is_cuda:
            self.torch.cuda.synchronize(self.raw.device)

    def ready(self) -> dict[str, Any]:
        from connector.kvcache import compatibility_fields, compatibility_signature
        from connector.metadata import PROTOCOL_VERSION, HandshakePayload, compatibility_hash

        fields = compatibility_fields(
            self.kv,
            model="gpu-check",
            model_dtype=self.cfg.dtype,
            cache_dtype="auto",
            attn_backend="none",
            num_kv_heads=self.total_heads,
            head_size=self.cfg.head_size,
            block_size=self.cfg.tokens,
            vllm_version="none",
        )
        compat = compatibility_hash(compatibility_signature(fields), self.layout)
        payload = HandshakePayload(
            PROTOCOL_VERSION, compat, self.role, self.backend.agent_name, self.backend.agent_metadata(), self.layout
        )
        return {
            "payload": payload.encode(),
            "compat_hash": compat,
            "mem_type": self.kv.mem_type,
            "device_id": self.kv.device_id,
            "device": self.device,
            "device_name": self._device_name(),
            "layout": self.kv.geometry.layout,
            "regions": len(self.layout.regions),
            "storages": len(self.kv.storages),
            "registrations": self.registrations,
            "descriptors": num_descriptors(self.layout),
            "block_bytes": sum(r.block_len for r in self.layout.regions),
            "head_bytes": self.layout.regions[0].block_len // self.cfg.heads,  # one head of one block of a layer
            "heads": self.cfg.heads,
            "timings": self.timings,
        }

    def _device_name(self) -> str:
        if self.raw.is_cuda:
            return str(self.torch.cuda.get_device_name(self.raw.device))
        return platform.processor() or platform.machine()

    def add_peer(
        self, raw_payload: bytes, slices: list[tuple[int, int, int]] | None = None, writes_to: bool = True
    ) -> float:
        """Load a peer; ``slices`` ((src, dst, length) byte ranges of each block): a TP leg writes only those."""
        from connector.metadata import HandshakePayload
        from connector.topology import Slice

        legs = tuple(Slice(*s) for s in slices) if slices is not None else None
        t = time.perf_counter()
        self.backend.add_peer(HandshakePayload.decode(raw_payload), slices=legs, writes_to=writes_to)
        return time.perf_counter() - t

    def write(self, peer: str, src: list[int], dst: list[int], tag: str, reps: int, timeout_s: float) -> dict[str, Any]:
        """P: post the WRITE ``reps`` times, each polled to completion; per-rep seconds."""
        self._sync()
        seconds: list[float] = []
        ticket = None
        for rep in range(reps):
            t = time.perf_counter()
            ticket = self.backend.write(peer, tuple(src), tuple(dst), f"{NOTICE}:{tag}:{rep}".encode())
            state = self.backend.write_state(ticket.handle)
            while state == "PROC" and time.perf_counter() - t < timeout_s:
                state = self.backend.write_state(ticket.handle)
            seconds.append(time.perf_counter() - t)
            released = self.backend.release(ticket.handle)
            if state != "DONE":
                return {"state": state, "seconds": seconds, "released": released}
        assert ticket is not None
        return {"state": "DONE", "seconds": seconds, "bytes": ticket.num_bytes, "descriptors": ticket.num_descriptors}

    def await_notice(self, tag: str | list[str], reps: int, timeout_s: float) -> dict[str, Any]:
        """D: poll notices until the last rep's notice of ``tag`` (of every tag of a list: one per source rank)
        arrived."""
        tags = [tag] if isinstance(tag, str) else tag
        want = {f"{NOTICE}:{t}:{reps - 1}".encode() for t in tags}
        prefixes = tuple(f"{NOTICE}:{t}:".encode() for t in tags)
        seen = 0
        t = time.perf_counter()
        while time.perf_counter() - t < timeout_s:
            for _, msg in self.backend.poll_notices():
                seen += msg.startswith(prefixes)
                want.discard(msg)
                if not want:
                    return {"seen": seen, "seconds": time.perf_counter() - t}
        return {"seen": seen, "seconds": None}

    def hashes(self, blocks: list[int]) -> list[str]:
        """SHA-256 of each block id across all layers (region order), computed on the host."""
        self._sync()
        out: list[str] = []
        for start in range(0, len(blocks), 256):
            ids = self.torch.tensor(blocks[start : start + 256], dtype=self.torch.long, device=self.raw.device)
            host = [layer.index_select(0, ids).cpu().numpy() for layer in self.pages]
            for k in range(len(ids)):
                h = hashlib.sha256()
                for layer in host:
                    h.update(layer[k].tobytes())
                out.append(h.hexdigest())
        return out

    def slice_hashes(self, blocks: list[int], ranges: list[tuple[int, int]]) -> list[str]:
        """SHA-256 of each block id's ``(offset, length)`` byte ranges across all layers (a TP leg's slices)."""
        self._sync()
        out: list[str] = []
        for start in range(0, len(blocks), 256):
            ids = self.torch.tensor(blocks[start : start + 256], dtype=self.torch.long, device=self.raw.device)
            host = [layer.index_select(0, ids).cpu().numpy() for layer in self.pages]
            for k in range(len(ids)):
                h = hashlib.sha256()
                for layer in host:
                    for offset, length in ranges:
                        h.update(layer[k, offset : offset + length].tobytes())
                out.append(h.hexdigest())
        return out

    def nonzero_outside(self, written: list[int]) -> int:
        """Bytes that are not zero in blocks nobody wrote (D)."""
        mask = self.torch.ones(self.cfg.blocks, dtype=self.torch.bool, device=self.raw.device)
        if written:
            mask[self.torch.tensor(written, dtype=self.torch.long, device=self.raw.device)] = False
        return int(sum(int(layer[mask].count_nonzero()) for layer in self.pages))

    def corrupt(self, block: int) -> None:
        self.pages[-1][block, 0] ^= 1
        self._sync()


def _peer_main(conn: Connection, role: str, cfg: CheckConfig, rank: int = 0) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        peer = _Peer(role, cfg, rank)
        conn.send(("ok", peer.ready()))
    except BaseException:  # noqa: BLE001  # reported to the parent (fails the check); the process ends
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, *args = conn.recv()
        if cmd == "close":
            peer.backend.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(peer, cmd)(*args)))
        except Exception:  # noqa: BLE001  # reported to the parent, which fails the check
            conn.send(("error", traceback.format_exc()))


# --------------------------------------------------------------------------------------------
# The parent: orchestration, verification, report
# --------------------------------------------------------------------------------------------


class CheckError(RuntimeError):
    """The check could not run (a process died, did not answer in time, or raised)."""


class _Remote:
    def __init__(self, ctx: Any, role: str, cfg: CheckConfig, deadline: float, rank: int = 0) -> None:
        self.role, self.deadline = (f"{role}{rank}" if cfg.p_tp > 1 or cfg.d_tp > 1 else role), deadline
        self.conn, child = ctx.Pipe()
        name = f"gpu-check-{self.role}"
        self.proc = ctx.Process(target=_peer_main, args=(child, role, cfg, rank), name=name, daemon=True)
        self.proc.start()
        child.close()

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def recv(self) -> Any:
        left = self.deadline - time.monotonic()
        if left <= 0 or not self.conn.poll(left):
            raise CheckError(f"{self.role} did not answer before the deadline")
        try:
            status, value = self.conn.recv()
        except EOFError as exc:
            raise CheckError(f"{self.role} died (exit code {self.proc.exitcode})") from exc
        if status != "ok":
            raise CheckError(f"{self.role} failed:\n{value}")
        return value

    def call(self, *cmd: Any) -> Any:
        self.send(*cmd)
        return self.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("close")
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12"):
        with contextlib.suppress(importlib_metadata.PackageNotFoundError):
            env[dist] = importlib_metadata.version(dist)
    env["ucx"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return env


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """Run the whole check; the result says ``ok`` and every figure (see the module docstring)."""
    started = time.monotonic()
    deadline = started + cfg.deadline_s
    result: dict[str, Any] = {"ok": False, "config": asdict(cfg), "environment": _environment(), "failures": []}
    ctx = mp.get_context("spawn")
    remotes = {role: _Remote(ctx, role, cfg, deadline) for role in ROLES}
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


def _run_rounds(cfg: CheckConfig, remotes: dict[str, _Remote], result: dict[str, Any]) -> None:
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


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    if cfg.p_tp > 1 or cfg.d_tp > 1:
        from connector.gpu_check_tp import run_tp_check

        result = run_tp_check(cfg)
    else:
        result = run_check(cfg)
    print(summary(result), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if result["ok"]:
        return 0
    return 2 if result.get("error") else 1


if __name__ == "__main__":
    raise SystemExit(main())
