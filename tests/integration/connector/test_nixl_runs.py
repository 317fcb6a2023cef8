"""Runs of blocks on real NIXL agents (DRAM, UCX over loopback): a WRITE of blocks consecutive on both sides is
posted as one descriptor per region (NIXL merges the prepared per-block entries; NIXL's own telemetry counts
what it posted), ``WriteTicket.num_descriptors`` says the same number, and every block lands where the per-block
definition puts it, nothing else written: whole blocks, a layer window, TP head slices; regions that touch stay
one descriptor each (NIXL merges within a prepared region only)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")

BLOCKS, BLOCK_LEN, LAYERS = 16, 256, 3


def _payload(backend: Any, layout: Any) -> Any:
    from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload

    return HandshakePayload(PROTOCOL_VERSION, "it", "x", backend.agent_name, backend.agent_metadata(), layout)


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, Any, Any]]:
    """P (random KV) and D (zeros), each one buffer of ``LAYERS`` regions; ``request.param``: (gap between
    regions in blocks, head slices or None)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["NIXL_TELEMETRY_ENABLE"] = "y"  # NIXL's count of the descriptors it posted
    import numpy as np

    from connector.transfer.nixl import NixlBackend
    from connector.wire.metadata import KVLayout, Region

    gap, slices = getattr(request, "param", (1, None))
    span = (BLOCKS + gap) * BLOCK_LEN
    src = np.random.default_rng(3).integers(0, 256, LAYERS * span, dtype=np.uint8)
    dst = np.zeros(LAYERS * span, np.uint8)

    def layout(a: Any) -> KVLayout:
        return KVLayout(
            "DRAM", 0, 16, tuple(Region(a.ctypes.data + i * span, BLOCK_LEN, BLOCKS) for i in range(LAYERS))
        )

    tag = f"{os.getpid()}-{request.node.name[-16:]}"
    p, d = NixlBackend(f"runs-p-{tag}", layout(src)), NixlBackend(f"runs-d-{tag}", layout(dst))
    p.add_peer(_payload(d, layout(dst)), slices=slices)
    try:
        yield p, d, src, dst
    finally:
        p.close()
        d.close()


def _write(p: Any, d: Any, local: tuple[int, ...], remote: tuple[int, ...], layers: Any = None) -> tuple[int, int]:
    """(our count, NIXL's count) of the descriptors of one completed WRITE."""
    ticket = p.write(d.agent_name, local, remote, b"", layers=layers)
    end = time.monotonic() + 10
    while p.write_state(ticket.handle) == "PROC" and time.monotonic() < end:
        d.poll_notices()
        time.sleep(0.001)
    assert p.write_state(ticket.handle) == "DONE"
    nixl_count = int(p._agent.get_xfer_telemetry(p._handles[ticket.handle]).descCount)
    assert p.release(ticket.handle)
    return ticket.num_descriptors, nixl_count


def _expected(src: Any, dst: Any, local: tuple[int, ...], remote: tuple[int, ...], layers: range, part: Any) -> Any:
    """D's buffer as the per-block definition leaves it."""
    span = len(src) // LAYERS
    want = dst.copy()
    off, length = part
    for layer in layers:
        for lb, rb in zip(local, remote, strict=True):
            at_src, at_dst = layer * span + lb * BLOCK_LEN + off, layer * span + rb * BLOCK_LEN + off
            want[at_dst : at_dst + length] = src[at_src : at_src + length]
    return want


CASES = [  # local, remote, layers, descriptors posted
    ((2, 3, 4, 5, 6, 7, 8, 9), (5, 6, 7, 8, 9, 10, 11, 12), None, 3),
    ((1, 2, 3, 7, 8, 12), (4, 5, 6, 9, 10, 0), None, 9),
    ((0, 2, 4), (9, 7, 5), None, 9),
    ((1, 2, 3, 4), (7, 8, 9, 10), (1, 3), 2),
]


@pytest.mark.parametrize(
    ("local", "remote", "layers", "posted"), CASES, ids=["one-run", "three-runs", "none", "window"]
)
def test_a_run_consecutive_on_both_sides_is_one_descriptor_per_region(
    agents: tuple[Any, Any, Any, Any], local: tuple[int, ...], remote: tuple[int, ...], layers: Any, posted: int
) -> None:
    p, d, src, dst = agents
    want = _expected(src, dst, local, remote, range(*(layers or (0, LAYERS))), (0, BLOCK_LEN))
    assert _write(p, d, local, remote, layers) == (posted, posted)
    assert bytes(dst) == bytes(want), "a byte landed elsewhere than the per-block definition puts it"


@pytest.mark.parametrize("agents", [(0, None)], indirect=True, ids=["back-to-back"])
def test_nixl_keeps_one_descriptor_per_region_where_regions_touch(agents: tuple[Any, Any, Any, Any]) -> None:
    p, d, src, dst = agents
    every = tuple(range(BLOCKS))
    assert _write(p, d, every, every) == (LAYERS, LAYERS)
    assert bytes(dst) == bytes(src)


def _half() -> Any:
    from connector.parallel.topology import Slice

    return (Slice(BLOCK_LEN // 2, 0, BLOCK_LEN // 2),)


@pytest.mark.parametrize("agents", [(1, _half())], indirect=True, ids=["head-slice"])
def test_head_slices_of_consecutive_blocks_stay_one_descriptor_each(agents: tuple[Any, Any, Any, Any]) -> None:
    p, d, src, dst = agents
    local, remote = (4, 5, 6), (1, 2, 3)
    assert _write(p, d, local, remote) == (9, 9)
    half = BLOCK_LEN // 2
    span = len(src) // LAYERS
    for layer in range(LAYERS):
        for lb, rb in zip(local, remote, strict=True):
            got = dst[layer * span + rb * BLOCK_LEN :][:BLOCK_LEN]
            assert bytes(got) == bytes(src[layer * span + lb * BLOCK_LEN + half :][:half]) + bytes(half)
    assert int(dst.sum()) == sum(
        int(src[layer * span + lb * BLOCK_LEN + half :][:half].sum()) for layer in range(LAYERS) for lb in local
    )


def test_a_notice_rides_on_a_write_of_long_runs_and_arrives_after_its_data(agents: tuple[Any, Any, Any, Any]) -> None:
    from connector.transfer.layout import block_runs, runs_as_lists

    p, d, src, dst = agents
    local, remote = tuple(range(0, 12)), tuple(range(4, 16))
    assert runs_as_lists(block_runs(local, remote)[2].size, len(local)), "the per-request list way"
    want = _expected(src, dst, local, remote, range(LAYERS), (0, BLOCK_LEN))
    ticket = p.write(d.agent_name, local, remote, b"done")
    assert ticket.num_descriptors == LAYERS and ticket.num_bytes == 12 * LAYERS * BLOCK_LEN
    notices: list[tuple[str, bytes]] = []
    end = time.monotonic() + 10
    while not notices and time.monotonic() < end:
        p.write_state(ticket.handle)
        notices = d.poll_notices()
        time.sleep(0.001)
    assert notices == [(p.agent_name, b"done")]
    assert bytes(dst) == bytes(want), "the notice arrived before its data"
    assert p.release(ticket.handle)
