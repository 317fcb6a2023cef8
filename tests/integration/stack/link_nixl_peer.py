"""One side of a NIXL WRITE across the link, as the P/D connectors do it: P (initiator) WRITEs a DRAM buffer into
D (target) in 64 KiB descriptors with a notification; D progresses UCX with its progress thread.

    python link_nixl_peer.py target HOST PORT BYTES      # prints {"sha": ...} of what arrived
    python link_nixl_peer.py initiator HOST PORT BYTES   # prints {"seconds": ..., "sha": ...} of the main WRITE

Run each inside its namespace with the engine environment of the link (UCX_TLS=tcp ...) or without it (cma).
Every wait is bounded (60 s).
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
DEADLINE = time.monotonic() + 60.0


def agent(name: str, progress_thread: bool, buf: Any) -> Any:
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM", backends=["UCX"])
    return a


def target(host: str, port: int, size: int) -> None:
    buf = np.zeros(size, np.uint8)
    a = agent("target", True, buf)
    with Listener((host, port), authkey=KEY) as listener, listener.accept() as conn:
        conn.send({"md": a.get_agent_metadata(), "addr": buf.ctypes.data})
        a.add_remote_agent(conn.recv())
        seen: set[bytes] = set()
        while b"main" not in seen and time.monotonic() < DEADLINE:
            for messages in a.get_new_notifs().values():
                seen.update(messages)
            time.sleep(0.002)
        conn.send(hashlib.sha256(buf.tobytes()).hexdigest() if b"main" in seen else None)
        conn.recv()  # the initiator's "quit": it is done with our memory


def write(a: Any, peer: str, src: Any, dst_addr: int, size: int, tag: bytes) -> float:
    n = size // BLOCK
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    remote = a.prep_xfer_dlist(peer, [(dst_addr + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")
    handle = a.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)), tag)
    t0 = time.monotonic()
    state = a.transfer(handle)
    while state == "PROC" and time.monotonic() < DEADLINE:
        time.sleep(0.001)
        state = a.check_xfer_state(handle)
    seconds = time.monotonic() - t0
    if state != "DONE":
        raise RuntimeError(f"WRITE {tag!r} ended {state}")
    handle.release()
    local.release()
    remote.release()
    return seconds


def initiator(host: str, port: int, size: int) -> None:
    src = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    a = agent("initiator", False, src)
    while True:
        try:
            conn = Client((host, port), authkey=KEY)
            break
        except OSError:
            if time.monotonic() > DEADLINE:
                raise
            time.sleep(0.05)
    with conn:
        info = conn.recv()
        peer = a.add_remote_agent(info["md"])
        peer = peer.decode() if isinstance(peer, bytes) else peer
        conn.send(a.get_agent_metadata())
        write(a, peer, src, info["addr"], BLOCK, b"warm")  # wire-up: UCX connects on the first WRITE
        time.sleep(0.2)  # the bucket refills: the main WRITE starts like any after a pause
        seconds = write(a, peer, src, info["addr"], size, b"main")
        arrived = conn.recv()
        conn.send("quit")
    print(json.dumps({"seconds": seconds, "sha": hashlib.sha256(src.tobytes()).hexdigest(), "arrived": arrived}))


if __name__ == "__main__":
    role, host, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    (target if role == "target" else initiator)(host, port, size)
