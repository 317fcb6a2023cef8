"""Head slices of unequal TP on real NIXL DRAM agents, one process per rank (issue 20 (e)).

Each rank is a child process with a ``NixlBackend`` over its own KV (2 layers, 12 blocks, 4 KV heads of
``HEAD`` bytes per block in total, split by TP as ``connector.parallel.topology`` says). The legs come from
``topology.plan``; each P rank loads its D peers with the legs' slices and WRITEs. Checked: every slice's
bytes on D equal the source's (SHA-256 per slice), every byte of a written block is covered, and blocks
nobody wrote stay zero. 2 P ranks -> 1 D rank and 1 P rank -> 2 D ranks.

Only the backend's sliced descriptors are exercised here; the transfer threads drive the same legs in
``test_nixl_tp_threads.py`` (one process) and ``test_nixl_tp_fanout.py`` (P1 -> D2, one process per rank).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")

HEADS, HEAD, BLOCKS, LAYERS = 4, 64, 12, 2


def rank_main(conn: Connection, name: str, tp: int, seed: int | None) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np

    from connector.parallel.topology import Slice
    from connector.transfer.nixl import NixlBackend
    from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload, KVLayout, Region

    block_len = HEADS // min(tp, HEADS) * HEAD if tp <= HEADS else HEAD
    rng = np.random.default_rng(seed)
    kv = [
        rng.integers(1, 256, BLOCKS * block_len, dtype=np.uint8)
        if seed is not None
        else np.zeros(BLOCKS * block_len, np.uint8)
        for _ in range(LAYERS)
    ]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, block_len, BLOCKS) for a in kv))
    backend = NixlBackend(name, layout)
    payload = HandshakePayload(PROTOCOL_VERSION, "it", name, name, backend.agent_metadata(), layout)
    conn.send(payload.encode())
    while True:
        cmd, *args = conn.recv()
        if cmd == "close":
            backend.close()
            conn.send("closed")
            return
        if cmd == "add_peer":
            slices = tuple(Slice(*s) for s in args[1]) if args[1] is not None else None
            backend.add_peer(HandshakePayload.decode(args[0]), writes_to=args[2], slices=slices)
            conn.send("ok")
        elif cmd == "write":
            conn.send(backend.write(args[0], tuple(args[1]), tuple(args[2]), b"").handle)
        elif cmd == "state":  # polling progresses this agent's UCX worker too
            state = backend.write_state(args[0])
            if state != "PROC":
                backend.release(args[0])
            conn.send(state)
        elif cmd == "poll":
            backend.poll_notices()  # progresses this agent's UCX worker (the WRITE's target over TCP)
            conn.send("ok")
        elif cmd == "sha":  # bytes [offset, offset + length) of each listed block, every layer
            blocks, offset, length = args
            h = hashlib.sha256()
            for region in kv:
                for b in blocks:
                    h.update(region[b * block_len + offset : b * block_len + offset + length].tobytes())
            conn.send(h.hexdigest())
        elif cmd == "zero":
            conn.send(all(not region[b * block_len : (b + 1) * block_len].any() for region in kv for b in args[0]))


class Rank:
    def __init__(self, ctx: Any, name: str, tp: int, seed: int | None) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, name, tp, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), f"{name} did not start"
        self.payload: bytes = self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(30), f"{self.name}: no answer to {cmd[0]}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("close")
        self.proc.join(10)


@pytest.fixture
def spawn() -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    ranks: list[Rank] = []

    def make(name: str, tp: int, seed: int | None) -> Rank:
        ranks.append(Rank(ctx, name, tp, seed))
        return ranks[-1]

    yield make
    for r in reversed(ranks):
        r.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["2P-to-1D", "1P-to-2D"])
def test_head_slices_land_in_the_right_byte_ranges(spawn: Any, p_tp: int, d_tp: int) -> None:
    from connector.parallel.topology import plan

    topo = plan(p_tp=p_tp, d_tp=d_tp, num_kv_heads=HEADS, head_bytes=HEAD, num_layers=LAYERS)
    tag = f"{p_tp}{d_tp}-{os.getpid()}"
    ps = [spawn(f"kvpush-tp-p{p}-{tag}", p_tp, seed=100 + p) for p in range(p_tp)]
    ds = [spawn(f"kvpush-tp-d{d}-{tag}", d_tp, seed=None) for d in range(d_tp)]
    src_blocks, dst_blocks = [1, 4, 7], [9, 2, 5]
    for leg in topo.legs:
        p, d = ps[leg.src.tp], ds[leg.dst]
        d.call("add_peer", p.payload, None, False)  # decode: notices only
        p.call("add_peer", d.payload, [(s.src, s.dst, s.length) for s in leg.slices], True)
        handle, state, end = p.call("write", d.name, src_blocks, dst_blocks), "PROC", time.monotonic() + 20
        while state == "PROC" and time.monotonic() < end:
            d.call("poll")  # over TCP the target must progress UCX too (no progress thread here)
            state = p.call("state", handle)
        assert state == "DONE", f"leg {leg} ended {state}"
    for leg in topo.legs:
        p, d = ps[leg.src.tp], ds[leg.dst]
        for s in leg.slices:
            assert d.call("sha", dst_blocks, s.dst, s.length) == p.call("sha", src_blocks, s.src, s.length), leg
    for d in range(d_tp):  # every byte of the written blocks came from some leg: nothing left zero
        covered = sorted((s.dst, s.length) for leg in topo.legs_into(d) for s in leg.slices)
        assert sum(length for _, length in covered) == topo.block_bytes(d_tp)
        assert not ds[d].call("zero", dst_blocks)
        untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert ds[d].call("zero", untouched), "a block nobody wrote is not zero"
