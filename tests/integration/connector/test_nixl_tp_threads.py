"""The TP wiring on real NIXL DRAM agents and the real TCP side channel (issue 20): one ``TransferThread`` per rank.

Every rank of a prefill engine (N ranks) and of a decode engine (M ranks) is a ``TransferThread`` with its own
``NixlBackend`` agent (UCX over loopback) in this process, its own side-channel listener on rank-0 port + rank
(``connector.parallel.ranks.rank_port``) and its ``RankInfo`` (4 KV heads of 64 bytes per block split by TP, 2 layer
regions). Each D rank dials the P ranks the topology makes its sources, each P rank checks the D rank's
geometry and writes its heads (whole blocks at equal TP, a slice of the D rank's blocks otherwise). Checked:
each D rank's blocks hold exactly its heads of the prefill's blocks (SHA-256), blocks nobody wrote stay zero,
every rank reports the request; at P_tp < D_tp one P rank fans out a slice of its blocks to each D rank and
releases its blocks once, after the last leg. The same path with faults runs in memory
(tests/unit/connector/test_transfer_thread_tp.py).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")

import numpy as np  # noqa: E402

from connector.options import Options  # noqa: E402
from connector.parallel.topology import heads_of  # noqa: E402
from connector.results import Results  # noqa: E402
from connector.transfer.nixl import NixlBackend  # noqa: E402
from connector.transfer_thread import TransferThread  # noqa: E402
from connector.wire.metadata import KVLayout, PeerAddress, RankId, RankInfo, Region  # noqa: E402
from connector.wire.plan import PrefillFinished, RegisterOrder  # noqa: E402

HEADS, HEAD_BYTES, BLOCKS, REGIONS = 4, 64, 12, 2
P_BLOCKS, D_BLOCKS = (3, 7, 8), (1, 4, 10)


def free_base(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it (the rank ports of one engine)."""
    for _ in range(50):
        base = int(np.random.default_rng().integers(20000, 60000))
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def engine(name: str, tp: int, model: np.ndarray | None) -> tuple[list[TransferThread], list[list[np.ndarray]]]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    base = free_base(tp)
    threads, kvs = [], []
    for r in range(tp):
        heads = heads_of(r, tp, HEADS)
        kv = [
            np.ascontiguousarray(model[g][:, list(heads)])
            if model is not None
            else np.zeros((BLOCKS, len(heads), HEAD_BYTES), np.uint8)
            for g in range(REGIONS)
        ]
        layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, len(heads) * HEAD_BYTES, BLOCKS) for a in kv))
        backend = NixlBackend(f"it-{name}-{r}-{os.getpid()}-{time.monotonic_ns()}", layout)
        thread = TransferThread(
            backend,
            engine_id=name,
            layout=layout,
            compat_hash="it-tp",
            side_host="127.0.0.1",
            side_port=base + r,
            options=Options(),
            rank=RankInfo(tp, 1, RankId(0, r), HEADS, heads, HEAD_BYTES, (0, REGIONS)),
        )
        thread.start()
        threads.append(thread)
        kvs.append(kv)
    return threads, kvs


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (2, 2), (1, 2)], ids=["P2-D1", "P2-D2", "P1-D2"])
def test_each_d_rank_gets_its_heads_from_its_source_ranks_on_real_nixl(p_tp: int, d_tp: int) -> None:
    model = np.random.default_rng(3).integers(1, 256, (REGIONS, BLOCKS, HEADS, HEAD_BYTES), dtype=np.uint8)
    p_threads, _ = engine("p0", p_tp, model)
    d_threads, d_kvs = engine("d0", d_tp, None)
    p_res, d_res = [Results() for _ in p_threads], [Results() for _ in d_threads]
    try:
        peer = PeerAddress("p0", "127.0.0.1", p_threads[0].side_port, tp_size=p_tp)
        for t in d_threads:
            t.submit(RegisterOrder("d1", "t:1", peer, D_BLOCKS, 48))
        for t in p_threads:
            t.submit(PrefillFinished("p1", "t:1", P_BLOCKS, 48))

        def all_received() -> bool:
            for t, r in zip(d_threads, d_res, strict=True):
                r.merge(t.collect_results())
            return all("d1" in r.received for r in d_res)

        wait_for(all_received)
        assert not any("d1" in r.failed for r in d_res)
        for d, kv in enumerate(d_kvs):
            heads = list(heads_of(d, d_tp, HEADS))
            for g in range(REGIONS):
                assert sha(kv[g][list(D_BLOCKS)]) == sha(model[g][list(P_BLOCKS)][:, heads]), f"D rank {d} layer {g}"
                untouched = [b for b in range(BLOCKS) if b not in D_BLOCKS]
                assert not kv[g][untouched].any(), "a block nobody wrote changed"

        def all_released() -> bool:
            for t, r in zip(p_threads, p_res, strict=True):
                r.merge(t.collect_results())
            return all("p1" in r.released for r in p_res)

        wait_for(all_released)
        assert [len(r.records) for r in p_res] == [max(1, d_tp // p_tp)] * p_tp, "one WRITE per leg"
    finally:
        for t in d_threads + p_threads:
            t.close()
