"""One side of a bare NIXL WRITE across the link, as the P/D connectors do it: P (initiator) WRITEs a DRAM buffer
into D (target) in 64 KiB descriptors (the bench model's block of one layer's K or V) with a notification; D
progresses UCX with its progress thread. The integration test (bytes follow the link, cma caught) and the
link-wire suite (our connector against bare NIXL on the same link) run it.

    python nixl_peer.py target HOST PORT BYTES [REPEATS]      # prints {"sha": ...} of what arrived
    python nixl_peer.py initiator HOST PORT BYTES [REPEATS [PAUSE_S]]
        # prints {"seconds": [...], "sha": ..., "arrived": ...}: REPEATS main WRITEs, PAUSE_S apart (the bucket
        # refills: each starts like a lone transfer after a pause)

Run each inside its namespace with the engine environment of the link (UCX_TLS=tcp ...) or without it (cma).
Every wait is bounded (60 s plus 30 s per repeat).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

BLOCK = 64 * 1024
KEY = b"kvpush-link-test"
DEADLINE_S = 60.0
PER_REPEAT_S = 30.0


def agent(name: str, progress_thread: bool, buf: Any) -> Any:
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM", backends=["UCX"])
    return a


def deadline(repeats: int) -> float:
    return time.monotonic() + DEADLINE_S + PER_REPEAT_S * repeats


def tag(i: int) -> bytes:
    return b"main" if i == 0 else f"main-{i}".encode()


def target(host: str, port: int, size: int, repeats: int = 1) -> None:
    buf = np.zeros(size, np.uint8)
    a = agent("target", True, buf)
    until, wanted = deadline(repeats), {tag(i) for i in range(repeats)}
    with Listener((host, port), authkey=KEY) as listener, listener.accept() as conn:
        conn.send({"md": a.get_agent_metadata(), "addr": buf.ctypes.data})
        a.add_remote_agent(conn.recv())
        seen: set[bytes] = set()
        while not wanted <= seen and time.monotonic() < until:
            for messages in a.get_new_notifs().values():
                seen.update(messages)
            time.sleep(0.002)
        conn.send(hashlib.sha256(buf.tobytes()).hexdigest() if wanted <= seen else None)
        conn.recv()  # the initiator's "quit": it is done with our memory


def write(a: Any, peer: str, src: Any, dst_addr: int, size: int, note: bytes, until: float) -> float:
    n = size // BLOCK
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    remote = a.prep_xfer_dlist(peer, [(dst_addr + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    handle = a.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)), note)
    t0 = time.monotonic()
    state = a.transfer(handle)
    while state == "PROC" and time.monotonic() < until:
        time.sleep(0.001)
        state = a.check_xfer_state(handle)
    seconds = time.monotonic() - t0
    if state != "DONE":
        raise RuntimeError(f"WRITE {note!r} ended {state}")
    handle.release()
    local.release()
    remote.release()
    return seconds


def initiator(host: str, port: int, size: int, repeats: int = 1, pause_s: float = 0.2) -> None:
    src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    a = agent("initiator", False, src)
    until = deadline(repeats)
    while True:
        try:
            conn = Client((host, port), authkey=KEY)
            break
        except OSError:
            if time.monotonic() > until:
                raise
            time.sleep(0.05)
    with conn:
        info = conn.recv()
        peer = a.add_remote_agent(info["md"])
        peer = peer.decode() if isinstance(peer, bytes) else peer
        conn.send(a.get_agent_metadata())
        write(a, peer, src, info["addr"], BLOCK, b"warm", until)  # wire-up: UCX connects on the first WRITE
        seconds = []
        for i in range(repeats):
            time.sleep(pause_s)  # the bucket refills: each main WRITE starts like any after a pause
            seconds.append(write(a, peer, src, info["addr"], size, tag(i), until))
        arrived = conn.recv()
        conn.send("quit")
    print(json.dumps({"seconds": seconds, "sha": hashlib.sha256(src.tobytes()).hexdigest(), "arrived": arrived}))


if __name__ == "__main__":
    role, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    if role == "target":
        target(host, port, size, repeats)
    else:
        initiator(host, port, size, repeats, float(sys.argv[6]) if len(sys.argv) > 6 else 0.2)
