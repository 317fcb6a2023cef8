"""How long decode takes to see a transfer end, per progress model: ``python -m loadtest.micro.notices``.

Two ``TransferThread`` s on real NIXL DRAM agents in this process (UCX over loopback, the real TCP side
channel), nobody kicking them (an idle engine). Decode registers, then prefill is told its blocks are
ready; measured: from that order to decode's ``collect_results`` naming the request (polled every 0.5 ms
by this thread), ``--repeat`` transfers of ``--blocks`` blocks x ``--block-len`` bytes x 2 layers.

Configurations: ``poll`` and ``thread`` (the ``progress`` option) with today's receive timer, and
``poll-idle-tick``: the receive timer slowed to the 0.1 s idle tick, which is how decode behaved before
it polled while a receive was in flight. Prints one JSON object (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

import numpy as np

from connector.options import Options, Polling
from connector.transfer.nixl import NixlBackend
from connector.transfer_thread import Results, TransferThread
from connector.wire.metadata import KVLayout, PeerAddress, Region
from connector.wire.plan import PrefillFinished, RegisterOrder


def side(engine: str, options: Options, blocks: int, block_len: int, seed: int | None) -> tuple[TransferThread, Any]:
    rng = np.random.default_rng(seed)
    kv = [
        rng.integers(0, 256, blocks * block_len, dtype=np.uint8)
        if seed is not None
        else np.zeros(blocks * block_len, np.uint8)
        for _ in range(2)
    ]
    layout = KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, block_len, blocks) for a in kv))
    name = f"bench-{engine}-{uuid.uuid4().hex[:6]}"
    delay = options.progress_thread_delay_us("127.0.0.1")  # this process: both agents on loopback
    backend = NixlBackend(name, layout, options.backends, progress_thread_delay_us=delay)
    thread = TransferThread(
        backend,
        engine_id=engine,
        layout=layout,
        compat_hash="bench",
        side_host="127.0.0.1",
        side_port=0,
        options=options,
    )
    thread.start()
    return thread, kv


def measure(options: Options, blocks: int, block_len: int, repeat: int) -> dict[str, float]:
    p, p_kv = side("P", options, blocks, block_len, seed=1)
    d, d_kv = side("D", options, blocks, block_len, seed=None)
    seen = Results()
    samples = []
    try:
        for i in range(repeat + 1):  # the first one includes the handshake: dropped
            key, req = f"t:{i}", f"d{i}"
            ids = tuple(range(blocks))
            d.submit(RegisterOrder(req, key, PeerAddress("P", "127.0.0.1", p.side_port), ids, blocks * 16))
            time.sleep(0.3)  # the registration reached P, and both threads went idle
            t0 = time.perf_counter()
            p.submit(PrefillFinished(f"p{i}", key, ids, blocks * 16))
            end = time.monotonic() + 30
            while req not in seen.received and time.monotonic() < end:
                seen.merge(d.collect_results())
                time.sleep(0.0005)
            assert req in seen.received and req not in seen.failed, f"transfer {i} did not complete"
            if i:
                samples.append((time.perf_counter() - t0) * 1e3)
            p.collect_results()
        assert all((a == b).all() for a, b in zip(p_kv, d_kv, strict=True)), "bench WRITE did not land"
    finally:
        d.close()
        p.close()
    return {"median_ms": round(statistics.median(samples), 2), "max_ms": round(max(samples), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-len", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    configs = {
        "poll": Options(),
        "thread": Options(progress="thread"),
        "poll-idle-tick": Options(polling=Polling(write_poll_min_s=0.1, write_poll_max_s=0.1, idle_wait_s=0.1)),
    }
    out: dict[str, Any] = {"bytes_per_transfer": 2 * a.blocks * a.block_len}
    for name, options in configs.items():
        out[name] = measure(options, a.blocks, a.block_len, a.repeat)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
