"""P_tp < D_tp end to end on real NIXL DRAM agents, one process per rank (issue 20: the prefill-side fan-out).

Each rank is a child process running a ``TransferThread`` over its own ``NixlBackend`` (UCX over loopback) with
the real TCP side channel on its rank port and its ``RankInfo`` (4 KV heads of 64 bytes per block split by TP,
2 layer regions, 12 blocks). One P rank holds every head; each of the two D ranks dials it, registers its own
blocks and is written a slice of P's blocks (its heads) by the P rank's fan-out. Checked: SHA-256 of every leg's
slice on D equals P's bytes of that slice, every byte of D's written blocks came from a leg, blocks nobody wrote
stay zero, each D rank reports the request received (not failed), and P releases its blocks once, after both
legs. The legs alone (backend slices) are in ``test_nixl_tp_slices.py``; faults run in memory
(``tests/unit/connector/test_transfer_thread_tp.py``).
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

HEADS, HEAD_BYTES, BLOCKS, REGIONS = 4, 64, 12, 2
P_BLOCKS, D_BLOCKS = (3, 7, 8), (1, 4, 10)


def rank_main(conn: Connection, engine: str, tp: int, rank: int, port: int, seed: int | None) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np

    from connector.options import Options
    from connector.parallel.topology import heads_of
    from connector.results import Results
    from connector.transfer.nixl import NixlBackend
    from connector.transfer_thread import TransferThread
    from connector.wire.metadata import KVLayout, PeerAddress, RankId, RankInfo, Region
    from connector.wire.plan import PrefillFinished, RegisterOrder

    heads = heads_of(rank, tp, HEADS)
    rng = np.random.default_rng(seed)
    shape = (BLOCKS, len(heads) * HEAD_BYTES)
    kv = [rng.integers(1, 256, shape, dtype=np.uint8) if seed is not None else np.zeros(shape, np.uint8) for _ in "kv"]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, shape[1], BLOCKS) for a in kv))
    thread = TransferThread(
        NixlBackend(f"fo-{engine}-{rank}-{os.getpid()}-{time.monotonic_ns()}", layout),
        engine_id=engine,
        layout=layout,
        compat_hash="it-fanout",
        side_host="127.0.0.1",
        side_port=port,
        options=Options(),
        rank=RankInfo(tp, 1, RankId(0, rank), HEADS, heads, HEAD_BYTES, (0, REGIONS)),
    )
    thread.start()
    results = Results()
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "register":  # D: the step plan's RegisterOrder (peer: P's rank-0 port and tp_size)
            peer = PeerAddress("p0", "127.0.0.1", args[0], tp_size=args[1])
            thread.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 48))
            conn.send("ok")
        elif cmd == "finished":  # P: the step plan's PrefillFinished
            thread.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 48))
            conn.send("ok")
        elif cmd == "results":
            results.merge(thread.collect_results())
            got = (sorted(results.received), sorted(results.failed), sorted(results.released), len(results.records))
            conn.send(got)
        elif cmd == "sha":  # bytes [offset, offset + length) of each listed block, every region
            blocks, offset, length = args
            h = hashlib.sha256()
            for region in kv:
                for b in blocks:
                    h.update(region[b, offset : offset + length].tobytes())
            conn.send(h.hexdigest())
        elif cmd == "zero":
            conn.send(all(not region[list(args[0])].any() for region in kv))
        elif cmd == "close":
            thread.close()
            conn.send("closed")
            return


class Rank:
    def __init__(self, ctx: Any, engine: str, tp: int, rank: int, port: int, seed: int | None) -> None:
        self.name = f"{engine}{rank}"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, engine, tp, rank, port, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(60) and self.conn.recv() == "ready", f"{self.name} did not start"

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(30), f"{self.name}: no answer to {cmd[0]}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("close")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def spawn() -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    ranks: list[Rank] = []

    def make(*args: Any) -> Rank:
        ranks.append(Rank(ctx, *args))
        return ranks[-1]

    yield make
    for r in reversed(ranks):
        r.close()


def wait_for(rank: Rank, cond: Any, timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = rank.call("results")
        if cond(got):
            return got
        time.sleep(0.02)
    raise AssertionError(f"{rank.name}: condition not met in time, last {got}")


def test_one_p_rank_fans_its_head_slices_out_to_two_d_ranks_in_their_own_processes(spawn: Any) -> None:
    from connector.parallel.topology import plan
    from tests.integration.connector.test_nixl_tp_threads import free_base

    p_base, d_base = free_base(1), free_base(2)
    p = spawn("p0", 1, 0, p_base, 11)
    ds = [spawn("d0", 2, r, d_base + r, None) for r in range(2)]
    for d in ds:
        assert d.call("register", p_base, 1) == "ok"
    assert p.call("finished") == "ok"
    for d in ds:
        _, failed, _, _ = wait_for(d, lambda got: "d1" in got[0])
        assert failed == [], f"{d.name} failed the request"
    _, _, released, writes = wait_for(p, lambda got: "p1" in got[2])
    assert released == ["p1"] and writes == 2, "one WRITE per leg, P's blocks released once"
    topo = plan(p_tp=1, d_tp=2, num_kv_heads=HEADS, head_bytes=HEAD_BYTES, num_layers=REGIONS)
    for leg in topo.legs:
        for s in leg.slices:
            want = p.call("sha", P_BLOCKS, s.src, s.length)
            assert ds[leg.dst].call("sha", D_BLOCKS, s.dst, s.length) == want, f"leg {leg} slice {s}"
    for d in range(2):
        assert sum(s.length for leg in topo.legs_into(d) for s in leg.slices) == topo.block_bytes(2)
        assert not ds[d].call("zero", D_BLOCKS), "written blocks hold data"
        assert ds[d].call("zero", [b for b in range(BLOCKS) if b not in D_BLOCKS]), "a block nobody wrote changed"
