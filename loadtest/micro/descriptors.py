"""Descriptor cost at GPU scale with real NIXL DRAM agents: ``python -m loadtest.micro.descriptors``.

Two ``NixlBackend`` agents in this process (UCX over loopback), each with a KV layout of ``--layers``
regions of ``--blocks`` blocks (default 64 x 60,000 = 3.84 M descriptors; ``--block-len`` bytes per
block keeps the memory small: the descriptor count, not the bytes, sets these costs). Measured, best
and median of ``--repeat`` runs, in milliseconds:

* ``local_prep`` / ``local_prep_full_list``: the agent's own list, prepared once at start (compact
  form / the old N x 3 list); ``agent_start_and_local_prep_ms``: agent creation, registration and it;
* ``add_peer``: a new decode peer on prefill: load its metadata + prepare its list (compact form);
* ``add_peer_full_list``: the same with the old N x 3 list, for comparison;
* ``add_peer_notices_only``: a new prefill peer on decode (no list: decode never WRITEs);
* ``request_indices``: one request's descriptor indices, both sides (``--tokens`` / block size blocks,
  scattered ids);
* ``request_make_prepped_xfer``: NIXL's handle for that request (its C++ per-descriptor work);
* ``request_write_call``: ``NixlBackend.write`` for it: indices + ``make_prepped_xfer`` + post (UCX
  posts one put per descriptor); the WRITE is then waited for, untimed.

Prints one JSON object. ``connector/README.md`` ("Descriptors at scale") carries the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from connector.layout import descriptor_indices, region_descriptors, strided_descriptors
from connector.metadata import PROTOCOL_VERSION, HandshakePayload, KVLayout, Region
from connector.transfer import NixlBackend

BLOCK_TOKENS = 16


def make_side(name: str, layers: int, blocks: int, block_len: int) -> tuple[NixlBackend, KVLayout, Any]:
    buf = np.zeros(layers * blocks * block_len, dtype=np.uint8)
    base = buf.ctypes.data
    regions = tuple(Region(base + i * blocks * block_len, block_len, blocks) for i in range(layers))
    layout = KVLayout("DRAM", 0, BLOCK_TOKENS, regions)
    rows = np.array([[base, buf.nbytes, 0]], dtype=np.uint64)
    return NixlBackend(name, layout, registrations=rows), layout, buf


def payload(backend: NixlBackend, layout: KVLayout) -> HandshakePayload:
    return HandshakePayload(
        PROTOCOL_VERSION, "bench", backend.agent_name, backend.agent_name, backend.agent_metadata(), layout
    )


def timed(fn: Callable[[], object], repeat: int, reset: Callable[[], object] | None = None) -> dict[str, float]:
    samples = []
    for _ in range(repeat):
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"best_ms": round(min(samples), 3), "median_ms": round(statistics.median(samples), 3)}


def run(layers: int, blocks: int, block_len: int, tokens: int, repeat: int) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    tag = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()
    p, p_layout, _p_buf = make_side(f"bench-p-{tag}", layers, blocks, block_len)
    local_prep_ms = (time.perf_counter() - t0) * 1e3
    d, d_layout, d_buf = make_side(f"bench-d-{tag}", layers, blocks, block_len)
    d_payload, p_payload = payload(d, d_layout), payload(p, p_layout)
    out: dict[str, Any] = {"layers": layers, "blocks": blocks, "descriptors": layers * blocks, "tokens": tokens}
    out["agent_start_and_local_prep_ms"] = round(local_prep_ms, 3)
    out["add_peer"] = timed(lambda: p.add_peer(d_payload), repeat, lambda: p.remove_peer(d.agent_name))
    agent: Any = p._agent  # the raw agent, for the old full-list figure only

    def full_list() -> None:
        agent.add_remote_agent(d_payload.agent_metadata)
        handle = agent.prep_xfer_dlist(d.agent_name, region_descriptors(d_layout), "DRAM")
        handle.release()
        agent.remove_remote_agent(d.agent_name)

    def local(make: Callable[[KVLayout], Any]) -> None:
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", make(p_layout), "DRAM").release()

    out["local_prep"] = timed(lambda: local(strided_descriptors), repeat)
    out["local_prep_full_list"] = timed(lambda: local(region_descriptors), repeat)
    p.remove_peer(d.agent_name)
    out["add_peer_full_list"] = timed(full_list, repeat)
    out["add_peer_notices_only"] = timed(
        lambda: d.add_peer(p_payload, writes_to=False), repeat, lambda: d.remove_peer(p.agent_name)
    )
    p.add_peer(d_payload)
    n = -(-tokens // BLOCK_TOKENS)
    rng = np.random.default_rng(0)
    src = tuple(int(b) for b in rng.choice(blocks, n, replace=False))
    dst = tuple(int(b) for b in rng.choice(blocks, n, replace=False))
    out["request_blocks"], out["request_descriptors"] = n, n * layers
    out["request_indices"] = timed(
        lambda: (descriptor_indices(p_layout, src), descriptor_indices(d_layout, dst)), repeat
    )
    li, ri = descriptor_indices(p_layout, src), descriptor_indices(d_layout, dst)
    remote_dlist = p._peers[d.agent_name].dlist
    out["request_make_prepped_xfer"] = timed(
        lambda: agent.make_prepped_xfer("WRITE", p._local_dlist, li, remote_dlist, ri, b"").release(), repeat
    )
    posts = []
    for _ in range(repeat):
        t = time.perf_counter()
        ticket = p.write(d.agent_name, src, dst, b"")
        posts.append((time.perf_counter() - t) * 1e3)
        end = time.monotonic() + 30
        while p.write_state(ticket.handle) == "PROC" and time.monotonic() < end:
            d.poll_notices()
        assert p.write_state(ticket.handle) == "DONE", "bench WRITE did not complete"
        p.release(ticket.handle)
    out["request_write_call"] = {"best_ms": round(min(posts), 3), "median_ms": round(statistics.median(posts), 3)}
    del d_buf
    p.close()
    d.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=60_000)
    ap.add_argument("--block-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.layers, a.blocks, a.block_len, a.tokens, a.repeat), indent=1))


if __name__ == "__main__":
    main()
