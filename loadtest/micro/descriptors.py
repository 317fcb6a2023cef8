"""Descriptor cost at GPU scale with real NIXL DRAM agents: ``python -m loadtest.micro.descriptors``.

Two ``NixlBackend`` agents in this process (UCX over loopback), each with a KV layout of ``--layers`` x
``--kv`` regions (K and V) of ``--blocks`` blocks (default 64 x 2 x 60,000 = 7.68 M descriptors; ``--block-len``
bytes per block keeps the memory small: the descriptor count, not the bytes, sets these costs).

``peers`` (best and median of ``--repeat``, ms): ``local_prep`` / ``local_prep_full_list`` (the agent's own list,
compact form / the old N x 3 list), ``add_peer`` (a new decode peer on prefill: load its metadata + prepare its
list), ``add_peer_full_list``, ``add_peer_notices_only`` (a new prefill peer on decode: no list).

``requests``: one row per request size (``--tokens``, 16-token blocks) x block-id pattern x way of writing, with
the write call's median and best over ``--repeat`` (ms; the WRITE is then waited for, untimed), the median of
making the transfer handle alone (ms, released unposted: where the ways differ, posting costs the same per
descriptor) and the descriptors it posts (NIXL's telemetry). Patterns: ``consecutive`` (one run on each side),
``mid_load`` (each side's ids runs of random length 1-16, drawn independently on P and D), ``mid_load_paired``
(the same run lengths on both sides), ``measured`` (runs consecutive on both sides as real engines handed them
out at mid load: 63 % single blocks, mean 1.95, the cpu-vllm suite at 4.5 QPS, run 20261207T201144Z, after
P-ordered pairs; the rest 2-5 blocks, uniform), ``scattered`` (no two ids adjacent in the request). Ways:

* ``per_block``: one descriptor per (region, block), NIXL's merge switched off (``skip_desc_merge``): the cost
  the issue assumed;
* ``prepped``: prepared per-block lists indexed (``NixlBackend.write`` for a request with short runs): NIXL
  merges index entries contiguous on both sides into one descriptor;
* ``run_lists``: our runs (``layout.run_descriptors``) handed over as per-request lists (``initialize_xfer``);
* ``write``: ``NixlBackend.write`` as it runs (it picks one of the two by the request's runs).

Prints one JSON object; ``--markdown`` prints the request table too. ``connector/README.md`` ("Descriptors at
scale") carries the figures.
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
import numpy.typing as npt

from connector.transfer.layout import (
    block_runs,
    descriptor_indices,
    posted_descriptors,
    region_descriptors,
    run_descriptors,
    runs_as_lists,
    strided_descriptors,
)
from connector.transfer.nixl import NixlBackend
from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload, KVLayout, Region

BLOCK_TOKENS = 16
PATTERNS = ("consecutive", "mid_load", "mid_load_paired", "measured", "scattered")
MEASURED_SINGLE = 0.63  # share of single-block runs on both sides (cpu-vllm 4.5 QPS, 201144Z); others 2-5 blocks
WAYS = ("per_block", "prepped", "run_lists", "write")
Ids = npt.NDArray[np.int64]


def make_side(name: str, regions: int, blocks: int, block_len: int) -> tuple[NixlBackend, KVLayout, Any]:
    buf = np.zeros(regions * blocks * block_len, dtype=np.uint8)
    base = buf.ctypes.data
    layout = KVLayout(
        "DRAM", 0, BLOCK_TOKENS, tuple(Region(base + i * blocks * block_len, block_len, blocks) for i in range(regions))
    )
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


def block_ids(pattern: str, n: int, blocks: int, rng: np.random.Generator) -> tuple[Ids, Ids]:
    """P's and D's block ids of one request of ``n`` blocks (distinct on each side)."""
    if pattern == "consecutive":
        lo_p, lo_d = (int(x) for x in rng.integers(0, blocks - n, 2))
        return np.arange(lo_p, lo_p + n), np.arange(lo_d, lo_d + n)
    if pattern == "scattered":  # every other id, shuffled: no two adjacent in the request
        return (rng.permutation(blocks // 2)[:n] * 2, rng.permutation(blocks // 2)[:n] * 2)
    if pattern == "measured":
        lengths = np.where(rng.random(n) < MEASURED_SINGLE, 1, rng.integers(2, 6, n))
        return _runs(lengths, n, blocks, rng), _runs(lengths, n, blocks, rng)
    lengths = rng.integers(1, 17, n)
    return _runs(lengths, n, blocks, rng), _runs(
        lengths if pattern == "mid_load_paired" else rng.integers(1, 17, n), n, blocks, rng
    )


def _runs(lengths: Ids, n: int, blocks: int, rng: np.random.Generator) -> Ids:
    """Runs of the given lengths (each at most 16) in distinct 17-block slots, until ``n`` ids."""
    slots = rng.permutation(blocks // 17)
    out: list[Ids] = []
    total = 0
    for slot, length in zip(slots, lengths, strict=False):
        out.append(np.arange(slot * 17, slot * 17 + int(length)))
        total += int(length)
        if total >= n:
            break
    return np.concatenate(out)[:n]


def requests(p: NixlBackend, d: NixlBackend, sizes: list[int], blocks: int, repeat: int) -> list[dict[str, Any]]:
    """The request table (module docstring)."""
    rng = np.random.default_rng(0)
    out = []
    for tokens in sizes:
        n = -(-tokens // BLOCK_TOKENS)
        for pattern in PATTERNS:
            src, dst = block_ids(pattern, n, blocks, rng)
            for way in WAYS:
                row = {"tokens": tokens, "pattern": pattern, "way": way, "blocks": n}
                row.update(_write_way(p, d, way, src, dst, repeat))
                out.append(row)
    return out


def _handle(p: NixlBackend, d: NixlBackend, way: str, src: Ids, dst: Ids) -> Any:
    """A transfer handle for the request, not posted (``write``: the way ``NixlBackend.write`` picks)."""
    agent: Any = p._agent  # the raw agent: the ways that NixlBackend does not take
    peer = p._peers[d.agent_name]
    if way == "write":
        way = "run_lists" if runs_as_lists(block_runs(src, dst)[2].size, src.size) else "prepped"
    if way == "run_lists":
        loc, rem = run_descriptors(p._layout, peer.layout, src, dst)
        local, remote = agent.get_xfer_descs(loc, "DRAM"), agent.get_xfer_descs(rem, "DRAM")
        return agent.initialize_xfer("WRITE", local, remote, d.agent_name, b"")
    li, ri = descriptor_indices(p._layout, src), descriptor_indices(peer.layout, dst)
    if way == "prepped":
        posted_descriptors(p._layout, peer.layout, tuple(src.tolist()), tuple(dst.tolist()))
    merge = way == "per_block"
    return agent.make_prepped_xfer("WRITE", p._local_dlist, li, peer.dlist, ri, b"", skip_desc_merge=merge)


def _write_way(p: NixlBackend, d: NixlBackend, way: str, src: Ids, dst: Ids, repeat: int) -> dict[str, Any]:
    """One row of the request table: the handle alone (released unposted), then the write call, waited for."""
    agent: Any = p._agent
    s, t = tuple(int(x) for x in src), tuple(int(x) for x in dst)
    handle = timed(lambda: _handle(p, d, way, src, dst).release(), repeat)
    samples, posted = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        if way == "write":
            xfer = p._handles[p.write(d.agent_name, s, t, b"").handle]
        else:
            xfer = _handle(p, d, way, src, dst)
            assert agent.transfer(xfer) != "ERR", "bench WRITE failed at post"
        samples.append((time.perf_counter() - t0) * 1e3)
        end = time.monotonic() + 60
        while agent.check_xfer_state(xfer) == "PROC" and time.monotonic() < end:
            d.poll_notices()
        assert agent.check_xfer_state(xfer) == "DONE", "bench WRITE did not complete"
        posted = int(agent.get_xfer_telemetry(xfer).descCount)
        if way == "write":
            assert p.release(max(p._handles))
        else:
            xfer.release()
    return {
        "write_call_median_ms": round(statistics.median(samples), 3),
        "write_call_best_ms": round(min(samples), 3),
        "handle_median_ms": handle["median_ms"],
        "descriptors": posted,
    }


def peers(p: NixlBackend, d: NixlBackend, repeat: int) -> dict[str, Any]:
    d_payload, p_payload = payload(d, d._layout), payload(p, p._layout)
    agent: Any = p._agent  # the raw agent, for the old full-list figures only
    out: dict[str, Any] = {
        "add_peer": timed(lambda: p.add_peer(d_payload), repeat, lambda: p.remove_peer(d.agent_name))
    }

    def full_list() -> None:
        agent.add_remote_agent(d_payload.agent_metadata)
        agent.prep_xfer_dlist(d.agent_name, region_descriptors(d._layout), "DRAM").release()
        agent.remove_remote_agent(d.agent_name)

    def local(make: Callable[[KVLayout], Any]) -> None:
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", make(p._layout), "DRAM").release()

    out["local_prep"] = timed(lambda: local(strided_descriptors), repeat)
    out["local_prep_full_list"] = timed(lambda: local(region_descriptors), repeat)
    p.remove_peer(d.agent_name)
    out["add_peer_full_list"] = timed(full_list, repeat)
    out["add_peer_notices_only"] = timed(
        lambda: d.add_peer(p_payload, writes_to=False), repeat, lambda: d.remove_peer(p.agent_name)
    )
    return out


def run(layers: int, kv: int, blocks: int, block_len: int, sizes: list[int], repeat: int) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_TELEMETRY_ENABLE", "y")
    tag = uuid.uuid4().hex[:6]
    regions = layers * kv
    p, _p_layout, _p_buf = make_side(f"bench-p-{tag}", regions, blocks, block_len)
    d, _d_layout, _d_buf = make_side(f"bench-d-{tag}", regions, blocks, block_len)
    out: dict[str, Any] = {"layers": layers, "regions": regions, "blocks": blocks, "descriptors": regions * blocks}
    out["peers"] = peers(p, d, repeat)
    p.add_peer(payload(d, d._layout))
    out["requests"] = requests(p, d, sizes, blocks, repeat)
    p.close()
    d.close()
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The request table: per size and pattern, each way's descriptors and write call median (best)."""
    head = "| tokens | pattern | " + " | ".join(f"{w}: descriptors, write call ms (handle ms)" for w in WAYS) + " |"
    lines = [head, "|" + "---|" * (2 + len(WAYS))]
    keyed = {(r["tokens"], r["pattern"], r["way"]): r for r in rows}
    for tokens, pattern in dict.fromkeys((r["tokens"], r["pattern"]) for r in rows):
        cells = [keyed[(tokens, pattern, w)] for w in WAYS]
        text = [f"{c['descriptors']:,}, {c['write_call_median_ms']} ({c['handle_median_ms']})" for c in cells]
        lines.append(f"| {tokens:,} | {pattern} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv", type=int, default=2, help="regions per layer (K and V)")
    ap.add_argument("--blocks", type=int, default=60_000)
    ap.add_argument("--block-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16_384])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.layers, a.kv, a.blocks, a.block_len, a.tokens, a.repeat)
    print(json.dumps(out, indent=1))
    if a.markdown:
        print(markdown(out["requests"]))


if __name__ == "__main__":
    main()
