"""Two transfer threads (prefill and decode) over the in-memory backend.

The side channel is real (loopback, ephemeral port); the data path is ``MemoryBackend``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from connector.memory_backend import MemoryBackend, MemoryFabric
from connector.metadata import KVLayout, PeerAddress, PrefillFailed, PrefillFinished, Region, RegisterOrder
from connector.rendezvous import Timeouts
from connector.transfer_thread import CancelOrder, Results, TransferThread

BLOCKS, BLOCK_LEN = 8, 64
FAST = Timeouts(lease_s=2, kv_timeout_s=3, write_grace_s=1, write_timeout_s=0.5, connect_timeout_s=2)


@dataclass
class Side:
    thread: TransferThread
    backend: MemoryBackend
    kv: list[np.ndarray]
    results: Results

    def block(self, b: int) -> bytes:
        return b"".join(r[b * BLOCK_LEN : (b + 1) * BLOCK_LEN].tobytes() for r in self.kv)

    def collect(self) -> Results:
        r = self.thread.drain()
        self.results.released |= r.released
        self.results.received |= r.received
        self.results.failed |= r.failed
        self.results.records += r.records
        self.results.counters.update(r.counters)
        return self.results


def make_side(fabric: MemoryFabric, engine: str, seed: int | None, compat: str = "c1") -> Side:
    rng = np.random.default_rng(seed)
    kv = [
        rng.integers(0, 256, BLOCKS * BLOCK_LEN, dtype=np.uint8)
        if seed is not None
        else np.zeros(BLOCKS * BLOCK_LEN, np.uint8)
        for _ in range(2)
    ]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, BLOCK_LEN, BLOCKS) for a in kv))
    backend = MemoryBackend(fabric, f"agent-{engine}", layout)
    thread = TransferThread(
        backend,
        engine_id=engine,
        layout=layout,
        compat_hash=compat,
        side_host="127.0.0.1",
        side_port=0,
        timeouts=FAST,
    )
    return Side(thread, backend, kv, Results())


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1), make_side(fabric, "D", seed=None)
    yield p, d
    d.thread.close()
    p.thread.close()


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def register(p: Side, d: Side, req: str = "d1", key: str = "t:1", blocks=(5, 6)) -> None:
    peer = PeerAddress("P", "127.0.0.1", p.thread.side_port)
    d.thread.submit(RegisterOrder(req, key, peer, blocks))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("prefill_first", [True, False])
def test_either_order_moves_the_blocks(pair, prefill_first):
    p, d = pair
    if prefill_first:
        p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
        time.sleep(0.05)
        register(p, d)
    else:
        register(p, d)
        time.sleep(0.2)
        p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "d1" in d.collect().received and "p1" in p.collect().released)
    assert d.results.failed == set()
    assert sha(d.block(5) + d.block(6)) == sha(p.block(1) + p.block(2))
    assert d.block(4) == bytes(2 * BLOCK_LEN)  # nothing else touched
    [record] = p.results.records
    assert record.num_bytes == 2 * 2 * BLOCK_LEN and record.num_descriptors == 4


def test_tail_blocks_are_aligned_when_decode_registers_fewer(pair):
    p, d = pair
    register(p, d, blocks=(7,))
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2, 3)))
    wait_for(lambda: "d1" in d.collect().received)
    assert d.block(7) == p.block(3)


def test_cancel_before_prefill_finishes_releases_decode_and_never_writes(pair):
    p, d = pair
    register(p, d)
    wait_for(lambda: p.thread._prefill.entries)  # registration reached P
    d.thread.submit(CancelOrder("d1"))
    wait_for(lambda: "d1" in d.collect().received)
    assert d.results.failed == {"d1"}
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    wait_for(lambda: "p1" in p.collect().released)
    time.sleep(0.05)
    assert d.block(5) == bytes(2 * BLOCK_LEN)
    assert p.results.records == []


def test_prefill_failure_reaches_decode_at_once(pair):
    p, d = pair
    register(p, d)
    wait_for(lambda: p.thread._prefill.entries)
    t0 = time.monotonic()
    p.thread.submit(PrefillFailed("p1", "t:1", "aborted"))
    wait_for(lambda: "d1" in d.collect().failed, timeout=1.0)
    assert time.monotonic() - t0 < 0.5


def test_prefill_failure_before_registration_is_remembered(pair):
    p, d = pair
    p.thread.submit(PrefillFailed("p1", "t:1", "aborted"))
    time.sleep(0.05)
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed, timeout=1.0)


def test_write_failure_is_told_to_decode(pair):
    p, d = pair
    p.backend.fail_writes = True
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d)
    wait_for(lambda: "d1" in d.collect().failed and "p1" in p.collect().released)
    assert p.results.counters["write_failed"] == 1


def test_prefill_gone_fails_waiting_decode_requests(pair):
    p, d = pair
    register(p, d)
    wait_for(lambda: p.thread._prefill.entries)
    p.thread.close()  # drops its side-channel links like a process exit
    wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
    assert d.results.counters["peer_lost"] == 1


def test_unmatched_state_expires(pair):
    p, d = pair
    p.thread.submit(PrefillFinished("p1", "t:1", (1, 2)))
    register(p, d, req="d9", key="t:other")
    wait_for(lambda: "p1" in p.collect().released, timeout=FAST.lease_s + 1)
    wait_for(lambda: "d9" in d.collect().failed, timeout=FAST.kv_timeout_s + 1)
    assert p.results.counters["expired"] >= 1
    wait_for(lambda: not p.thread._prefill.entries and not d.thread._decode.entries, timeout=FAST.lease_s + 1)


def test_incompatible_peer_is_refused():
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1, compat="c1"), make_side(fabric, "D", seed=None, compat="c2")
    try:
        register(p, d)
        wait_for(lambda: "d1" in d.collect().failed, timeout=2.0)
        assert p.thread._agents == {}
    finally:
        d.thread.close()
        p.thread.close()


def test_many_transfers_concurrently(pair):
    p, d = pair
    for i in range(4):
        register(p, d, req=f"d{i}", key=f"t:{i}", blocks=(4 + i,))
        p.thread.submit(PrefillFinished(f"p{i}", f"t:{i}", (i,)))
    wait_for(lambda: len(d.collect().received) == 4 and len(p.collect().released) == 4)
    assert d.results.failed == set()
    assert [d.block(4 + i) for i in range(4)] == [p.block(i) for i in range(4)]
