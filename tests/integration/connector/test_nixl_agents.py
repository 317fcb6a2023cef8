"""Two real NIXL agents in two processes on DRAM, each behind our transfer thread.

Covers the side-channel handshake (version + compatibility hash), the registration notice,
the WRITE with its completion notice, cancel and failure notices; data checked by SHA-256.
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

BLOCKS, BLOCK_LEN, REGIONS = 16, 4096, 2


def peer_main(conn: Connection, engine: str, seed: int | None, progress: str = "poll") -> None:
    """Child process: one agent + transfer thread, driven by commands from the test."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np

    from connector.options import Options
    from connector.orders import CancelOrder
    from connector.rendezvous.actions import Timeouts
    from connector.transfer.nixl import NixlBackend
    from connector.transfer_thread import Results, TransferThread
    from connector.wire.metadata import KVLayout, PeerAddress, Region
    from connector.wire.plan import PrefillFailed, PrefillFinished, RegisterOrder

    rng = np.random.default_rng(seed)
    kv = [
        rng.integers(0, 256, BLOCKS * BLOCK_LEN, dtype=np.uint8)
        if seed is not None
        else np.zeros(BLOCKS * BLOCK_LEN, np.uint8)
        for _ in range(REGIONS)
    ]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, BLOCK_LEN, BLOCKS) for a in kv))
    timeouts = Timeouts(lease_s=5, kv_timeout_s=8, write_grace_s=3, write_timeout_s=2, connect_timeout_s=5)
    options = Options(timeouts=timeouts, progress=progress)
    delay = options.progress_thread_delay_us("127.0.0.1")  # both agents in this machine's processes
    backend = NixlBackend(f"kvpush-{engine}-{os.getpid()}", layout, progress_thread_delay_us=delay)
    thread = TransferThread(
        backend,
        engine_id=engine,
        layout=layout,
        compat_hash="it",
        side_host="127.0.0.1",
        side_port=0,
        options=options,
    )
    thread.start()
    seen = Results()
    conn.send(thread.side_port)
    while True:
        cmd, *args = conn.recv()
        if cmd == "close":
            thread.close()
            conn.send("closed")
            return
        if cmd == "finish":
            thread.submit(PrefillFinished(args[0], args[1], tuple(args[2])))
        elif cmd == "fail":
            thread.submit(PrefillFailed(args[0], args[1], "aborted"))
        elif cmd == "register":
            peer = PeerAddress("P", "127.0.0.1", args[2])
            thread.submit(RegisterOrder(args[0], args[1], peer, tuple(args[3]), len(args[3]) * 16))
        elif cmd == "cancel":
            thread.submit(CancelOrder(args[0]))
        elif cmd == "results":
            seen.merge(thread.collect_results())
        elif cmd == "sha":
            data = b"".join(region[b * BLOCK_LEN : (b + 1) * BLOCK_LEN].tobytes() for b in args[0] for region in kv)
            conn.send(hashlib.sha256(data).hexdigest())
            continue
        conn.send(
            {"released": seen.released, "received": seen.received, "failed": seen.failed, "records": seen.records}
        )


class Peer:
    def __init__(self, ctx: Any, engine: str, seed: int | None, progress: str = "poll") -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, engine, seed, progress), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), f"{engine} did not start"
        self.port: int = self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(30), f"no answer to {cmd}"
        return self.conn.recv()

    def wait(self, pred: Any, timeout: float = 10.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            r: dict[str, Any] = self.call("results")
            if pred(r) or time.monotonic() > end:
                return r
            time.sleep(0.01)

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("close")
        self.proc.join(10)


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Peer, Peer]]:
    ctx = mp.get_context("spawn")
    p, d = Peer(ctx, "P", seed=7), Peer(ctx, "D", seed=None)
    yield p, d
    d.close()
    p.close()


ZERO_SHA: dict[int, str] = {}


def zero_sha(n: int) -> str:
    return ZERO_SHA.setdefault(n, hashlib.sha256(bytes(n * REGIONS * BLOCK_LEN)).hexdigest())


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "registration-first"])
def test_write_lands_with_completion(agents: tuple[Peer, Peer], prefill_first: bool) -> None:
    p, d = agents
    key, dreq, preq = f"t:w{prefill_first}", f"d-w{prefill_first}", f"p-w{prefill_first}"
    src, dst = ([1, 2, 3], [8, 9, 10]) if prefill_first else ([4, 5], [11, 12])
    steps = [(p, ("finish", preq, key, src)), (d, ("register", dreq, key, p.port, dst))]
    for target, step in steps if prefill_first else steps[::-1]:
        target.call(*step)
        time.sleep(0.1)
    r = d.wait(lambda r: dreq in r["received"])
    assert dreq in r["received"] and dreq not in r["failed"]
    assert d.call("sha", dst) == p.call("sha", src)
    rp = p.wait(lambda r: preq in r["released"])
    assert preq in rp["released"]
    assert any(rec.num_bytes == len(src) * REGIONS * BLOCK_LEN for rec in rp["records"])


def test_a_write_lands_with_the_event_driven_progress_thread_on_both_sides() -> None:
    """``progress: thread`` (issue 21): NIXL's UCX progress thread with a poll() delay, not its busy loop."""
    ctx = mp.get_context("spawn")
    p, d = Peer(ctx, "P", seed=11, progress="thread"), Peer(ctx, "D", seed=None, progress="thread")
    try:
        d.call("register", "d-t", "t:t", p.port, [8, 9])
        time.sleep(0.1)
        p.call("finish", "p-t", "t:t", [1, 2])
        r = d.wait(lambda r: "d-t" in r["received"])
        assert "d-t" in r["received"] and "d-t" not in r["failed"]
        assert d.call("sha", [8, 9]) == p.call("sha", [1, 2])
        assert d.call("sha", [10]) == zero_sha(1)
    finally:
        d.close()
        p.close()


def test_cancel_is_acked_and_nothing_is_written(agents: tuple[Peer, Peer]) -> None:
    p, d = agents
    d.call("register", "d-c", "t:c", p.port, [13, 14])
    time.sleep(0.3)  # registration reaches P
    d.call("cancel", "d-c")
    r = d.wait(lambda r: "d-c" in r["received"])
    assert "d-c" in r["failed"]
    p.call("finish", "p-c", "t:c", [1, 2])
    assert "p-c" in p.wait(lambda r: "p-c" in r["released"])["released"]
    time.sleep(0.1)
    assert d.call("sha", [13, 14]) == zero_sha(2)


def test_prefill_failure_is_notified(agents: tuple[Peer, Peer]) -> None:
    p, d = agents
    d.call("register", "d-f", "t:f", p.port, [15])
    time.sleep(0.3)
    t0 = time.monotonic()
    p.call("fail", "p-f", "t:f")
    r = d.wait(lambda r: "d-f" in r["failed"], timeout=3)
    assert "d-f" in r["failed"]
    assert time.monotonic() - t0 < 2
    assert d.call("sha", [15]) == zero_sha(1)


def _payload(backend: Any, layout: Any) -> Any:
    from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload

    return HandshakePayload(PROTOCOL_VERSION, "it", "x", backend.agent_name, backend.agent_metadata(), layout)


def _notices_within(backend: Any, sender: Any, seconds: float) -> list[tuple[str, bytes]]:
    end = time.monotonic() + seconds
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < end:
        sender.poll_notices()  # progresses the sender's UCX worker too
        got = backend.poll_notices()
        time.sleep(0.01)
    return got


def test_a_peer_restarted_under_the_same_agent_name_is_reloaded() -> None:
    """G8 on real NIXL: new metadata under a known name replaces the stale agent (it used to be
    kept, so every notice went to the dead incarnation)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np

    from connector.transfer.nixl import NixlBackend
    from connector.wire.metadata import KVLayout, Region

    arrays = [np.zeros(BLOCKS * BLOCK_LEN, np.uint8) for _ in range(3)]
    layouts = [KVLayout("DRAM", 0, 16, (Region(a.ctypes.data, BLOCK_LEN, BLOCKS),)) for a in arrays]
    d = NixlBackend("kvpush-reload-d", layouts[0])
    first = NixlBackend("kvpush-reload-p", layouts[1])
    d.add_peer(_payload(first, layouts[1]))
    first.add_peer(_payload(d, layouts[0]))
    d.send_notice("kvpush-reload-p", b"to-first")
    assert _notices_within(first, d, 5) == [("kvpush-reload-d", b"to-first")]
    first.close()
    del first
    second = NixlBackend("kvpush-reload-p", layouts[2])  # same name, new incarnation
    try:
        d.add_peer(_payload(second, layouts[2]))
        second.add_peer(_payload(d, layouts[0]))
        d.send_notice("kvpush-reload-p", b"to-second")
        assert _notices_within(second, d, 5) == [("kvpush-reload-d", b"to-second")]
    finally:
        second.close()
        d.close()


def test_a_frozen_prefill_fails_the_waiting_decode_request_within_the_liveness_bound() -> None:
    """G2 + G3 on real processes: prefill is SIGSTOPped while decode waits for its KV; decode reports the
    request failed within the heartbeat bound, and keeps its blocks (quarantine: the frozen process could
    still post a WRITE when it resumes) instead of reporting them free."""
    import signal

    from connector.wire.side_channel import Liveness

    ctx = mp.get_context("spawn")
    p, d = Peer(ctx, "P", seed=3), Peer(ctx, "D", seed=None)
    try:
        d.call("register", "d-z", "t:z", p.port, [3])
        time.sleep(0.5)  # the registration reached P, which holds it (no prefill yet)
        assert p.proc.pid is not None
        os.kill(p.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        # within the liveness bound (+3 s of slack on a loaded box), before its 8 s KV deadline could end it
        r = d.wait(lambda r: "d-z" in r["failed"], timeout=Liveness().bound_s + 3)
        assert "d-z" in r["failed"], "decode never noticed the frozen prefill"
        print(f"decode failed the request {time.monotonic() - t0:.2f} s after SIGSTOP")
        assert "d-z" not in r["received"], "blocks reported free on a lost link"
        os.kill(p.proc.pid, signal.SIGCONT)
    finally:
        if p.proc.pid is not None and p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGCONT)
        d.close()
        p.close()
