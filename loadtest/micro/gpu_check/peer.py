"""The GPU check's peers: one peer process (P or D, or one TP rank of either) with its KV cache (caches.py), its
NIXL backend and the commands the parent sends it; the parent's handle on it (`Remote`); where a failed check
stopped (`failed_stage`). Used by the single pair (check.py) and the TP pair (tp.py); imports neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import time
import traceback
from dataclasses import replace
from importlib import metadata as importlib_metadata
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from connector.transfer.layout import num_descriptors
from loadtest.micro.gpu_check.caches import vllm_like_caches, vmm_caches
from loadtest.micro.gpu_check.config import NOTICE, CheckConfig

if TYPE_CHECKING:
    from loadtest.micro.gpu_check.vmm import VmmBuffer

# --------------------------------------------------------------------------------------------
# One peer process
# --------------------------------------------------------------------------------------------


class Peer:
    """P or D inside its process: the cache, its description, the NIXL backend. Under TP, TP rank
    ``rank`` of its side: its cache holds only that rank's heads (``connector.parallel.topology.heads_of``),
    P's bytes seeded per rank."""

    def __init__(self, role: str, cfg: CheckConfig, rank: int = 0, stages: list[str] | None = None) -> None:
        import torch

        from connector.kvcache import describe_kv_caches
        from connector.parallel.topology import heads_of
        from connector.transfer.nixl import NixlBackend

        self.role, self.rank = role, rank
        self.total_heads = cfg.heads
        tp = cfg.p_tp if role == "P" else cfg.d_tp
        self.cfg = cfg = replace(cfg, heads=len(heads_of(rank, tp, cfg.heads)), seed=cfg.seed + rank)
        self.device = cfg.device if role == "P" else cfg.decode_device
        self.torch = torch
        self.timings: dict[str, float] = {}
        stages = [] if stages is None else stages  # how far it got: a failure names its stage (`failed_stage`)
        stages.append("alloc")
        t = time.perf_counter()
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {self.device}: torch {torch.__version__} sees no CUDA GPU")
            index = torch.device(self.device).index
            torch.cuda.set_device(0 if index is None else index)
            self.device = f"cuda:{torch.cuda.current_device()}"
        self.vmm: VmmBuffer | None = None
        if cfg.alloc == "vmm":
            caches, self.raw, self.vmm = vmm_caches(cfg, self.device)
        else:
            caches, self.raw = vllm_like_caches(cfg, self.device)
        if role == "P":
            gen = torch.Generator(device=self.raw.device).manual_seed(cfg.seed)
            self.raw.random_(-128, 128, generator=gen)
        self._sync()
        self.timings["alloc_s"] = time.perf_counter() - t
        stages.append("describe")
        t = time.perf_counter()
        self.kv = describe_kv_caches(caches, num_blocks=cfg.blocks, kv_buffer_device=self.device.split(":")[0])
        self.layout = self.kv.layout(cfg.tokens)
        self.timings["describe_s"] = time.perf_counter() - t
        base = int(self.raw.data_ptr())  # the whole cache, whatever storages its layers' views have
        self.pages = [  # per layer: [blocks, block_len] bytes over the backing buffer
            self.raw[start : start + r.block_len * r.num_blocks].view(r.num_blocks, r.block_len)
            for start, r in zip(
                (self.kv.storages[i].base + off - base for i, off in self.kv.region_offsets),
                self.kv.regions,
                strict=True,
            )
        ]
        stages.append("register")
        t = time.perf_counter()
        name = f"kvpush-gpucheck-{role}{rank}-{os.getpid()}"
        self.backend = NixlBackend(name, self.layout, cfg.backends, registrations=self.kv.registrations())
        self.registrations = len(self.kv.storages)  # one per backing storage, not one per layer
        self.timings["backend_s"] = time.perf_counter() - t
        stages.append("ready")

    def _sync(self) -> None:
        if self.raw.is_cuda:
            self.torch.cuda.synchronize(self.raw.device)

    def ready(self) -> dict[str, Any]:
        from connector.kvcache import compatibility_fields, compatibility_signature
        from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload, compatibility_hash

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
            **self._vmm_record(),
        }

    def _vmm_record(self) -> dict[str, Any]:
        """Under ``alloc: vmm``: the chunks and how many NIXL registrations span more than one of them."""
        if self.vmm is None:
            return {"alloc": "cudamalloc"}
        from loadtest.micro.gpu_check.vmm import spanning

        regions = [(s.base, s.nbytes) for s in self.kv.storages]
        return {
            "alloc": "vmm",
            "vmm_chunks": len(self.vmm.handles),
            "vmm_chunk_bytes": self.vmm.chunk_bytes,
            "vmm_rdma_flag": self.vmm.rdma,
            "registrations_spanning_chunks": spanning(regions, self.vmm.ptr, self.vmm.chunk_bytes),
        }

    def close(self) -> None:
        self.backend.close()
        if self.vmm is not None:
            del self.pages, self.raw, self.kv  # no view of the range outlives it
            self.vmm.close()

    def _device_name(self) -> str:
        if self.raw.is_cuda:
            return str(self.torch.cuda.get_device_name(self.raw.device))
        return platform.processor() or platform.machine()

    def add_peer(
        self, raw_payload: bytes, slices: list[tuple[int, int, int]] | None = None, writes_to: bool = True
    ) -> float:
        """Load a peer; ``slices`` ((src, dst, length) byte ranges of each block): a TP leg writes only those."""
        from connector.parallel.topology import Slice
        from connector.wire.metadata import HandshakePayload

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


def peer_main(conn: Connection, role: str, cfg: CheckConfig, rank: int = 0) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    stages: list[str] = []
    try:
        peer = Peer(role, cfg, rank, stages)
        conn.send(("ok", peer.ready()))
    except BaseException:  # noqa: BLE001  # reported to the parent (fails the check); the process ends
        conn.send(("error", f"[stage {stages[-1] if stages else 'start'}] {traceback.format_exc()}"))
        return
    while True:
        cmd, *args = conn.recv()
        if cmd == "close":
            peer.close()
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


class Remote:
    def __init__(self, ctx: Any, role: str, cfg: CheckConfig, deadline: float, rank: int = 0) -> None:
        self.role, self.deadline = (f"{role}{rank}" if cfg.p_tp > 1 or cfg.d_tp > 1 else role), deadline
        self.conn, child = ctx.Pipe()
        name = f"gpu-check-{self.role}"
        self.proc = ctx.Process(target=peer_main, args=(child, role, cfg, rank), name=name, daemon=True)
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


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12"):
        with contextlib.suppress(importlib_metadata.PackageNotFoundError):
            env[dist] = importlib_metadata.version(dist)
    env["ucx"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return env


STAGE = re.compile(r"\[stage (\w+)\]")


def failed_stage(result: dict[str, Any]) -> str | None:
    """Where a check that did not pass stopped: a peer's stage (alloc, describe, register, ready), "write" when a
    round's WRITE or notice failed, "verify" when blocks differ; None when it passed."""
    if result.get("ok"):
        return None
    for failure in result.get("failures", []):
        if found := STAGE.search(failure):
            return found.group(1)
    if any(row.get("state") != "DONE" for row in result.get("rounds", [])):
        return "write"
    return "verify"
