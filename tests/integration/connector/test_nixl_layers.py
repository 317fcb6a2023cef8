"""Layer-wise push on real NIXL agents (DRAM, UCX over loopback): a WRITE of a layer range moves exactly those
layers' regions (whole blocks and TP head slices), and ``LayeredBackend`` posts a step's layers as they are
marked, with Done delivered only after the last layer landed (``connector.transfer.layered``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")

BLOCKS, BLOCK_LEN, LAYERS = 8, 4096, 3


def _payload(backend: Any, layout: Any) -> Any:
    from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload

    return HandshakePayload(PROTOCOL_VERSION, "it", "x", backend.agent_name, backend.agent_metadata(), layout)


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, list[Any], list[Any]]]:
    """P (random KV) and D (zeros), D loaded by P to WRITE (with ``request.param`` head slices, or whole blocks)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import numpy as np

    from connector.transfer.nixl import NixlBackend
    from connector.wire.metadata import KVLayout, Region

    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(LAYERS)]
    dst = [np.zeros(BLOCKS * BLOCK_LEN, np.uint8) for _ in range(LAYERS)]

    def layout(arrays: list[Any]) -> KVLayout:
        return KVLayout("DRAM", 0, 16, tuple(Region(a.ctypes.data, BLOCK_LEN, BLOCKS) for a in arrays))

    tag = f"{os.getpid()}-{request.node.name[-12:]}"
    p, d = NixlBackend(f"layers-p-{tag}", layout(src)), NixlBackend(f"layers-d-{tag}", layout(dst))
    d.add_peer(_payload(p, layout(src)), writes_to=False)
    p.add_peer(_payload(d, layout(dst)), slices=getattr(request, "param", None))
    try:
        yield p, d, src, dst
    finally:
        p.close()
        d.close()


def _until_done(p: Any, handle: int, d: Any) -> list[tuple[str, bytes]]:
    notices: list[tuple[str, bytes]] = []
    end = time.monotonic() + 10
    while time.monotonic() < end:
        state = p.write_state(handle)
        notices += d.poll_notices()
        assert state != "ERR"
        if state == "DONE":
            break
        time.sleep(0.001)
    end = time.monotonic() + 5
    while not notices and time.monotonic() < end:
        p.poll_notices()
        notices += d.poll_notices()
        time.sleep(0.005)
    return notices


def block(arrays: list[Any], layer: int, b: int, length: int = BLOCK_LEN) -> bytes:
    return bytes(arrays[layer][b * BLOCK_LEN : b * BLOCK_LEN + length].tobytes())


def test_a_write_of_one_layer_moves_only_that_layers_blocks(agents: tuple[Any, Any, list[Any], list[Any]]) -> None:
    p, d, src, dst = agents
    ticket = p.write(d.agent_name, (1, 2), (5, 6), b"one", layers=(1, 2))
    assert _until_done(p, ticket.handle, d) == [(p.agent_name, b"one")]
    assert ticket.num_bytes == 2 * BLOCK_LEN
    assert block(dst, 1, 5) + block(dst, 1, 6) == block(src, 1, 1) + block(src, 1, 2)
    zero = bytes(BLOCK_LEN)
    assert [block(dst, layer, b) for layer in (0, 2) for b in (5, 6)] == [zero] * 4, "another layer was written"


def _half() -> Any:
    from connector.parallel.topology import Slice

    return (Slice(0, 0, BLOCK_LEN // 2),)


@pytest.mark.parametrize("agents", [_half()], indirect=True, ids=["head-slice"])
def test_a_sliced_write_of_one_layer_moves_only_its_slice_of_that_layer(
    agents: tuple[Any, Any, list[Any], list[Any]],
) -> None:
    p, d, src, dst = agents
    ticket = p.write(d.agent_name, (3,), (4,), b"", layers=(2, 3))
    _until_done(p, ticket.handle, d)
    half = BLOCK_LEN // 2
    assert ticket.num_bytes == half
    assert block(dst, 2, 4, half) == block(src, 2, 3, half)
    assert block(dst, 2, 4) == block(src, 2, 3, half) + bytes(half), "past the slice"
    assert block(dst, 1, 4) == bytes(BLOCK_LEN) and block(dst, 0, 4) == bytes(BLOCK_LEN)


def test_layers_are_posted_as_marked_and_done_arrives_after_the_last(
    agents: tuple[Any, Any, list[Any], list[Any]],
) -> None:
    from connector.transfer.layered import LayeredBackend, StepLayers
    from connector.transfer.ready import READY

    p, d, src, dst = agents
    layered = LayeredBackend(p, LAYERS, BLOCK_LEN)
    step = StepLayers(LAYERS)
    ticket = layered.write_layered(d.agent_name, (0, 1), (2, 3), b"done", step)
    assert layered.parts_posted == 0 and layered.write_state(ticket.handle) == "PROC"
    step.mark(0, READY)
    end = time.monotonic() + 10
    while block(dst, 0, 3) != block(src, 0, 1) and time.monotonic() < end:
        assert layered.write_state(ticket.handle) == "PROC", "done with two layers not computed"
        time.sleep(0.001)
    assert block(dst, 0, 2) == block(src, 0, 0)
    assert block(dst, 1, 2) == bytes(BLOCK_LEN), "layer 1 written before it was marked"
    assert d.poll_notices() == [], "Done before every layer"
    step.close(READY)
    assert _until_done(layered, ticket.handle, d) == [(p.agent_name, b"done")]
    assert ticket.num_bytes == LAYERS * 2 * BLOCK_LEN
    assert all(
        block(dst, layer, 2) + block(dst, layer, 3) == block(src, layer, 0) + block(src, layer, 1)
        for layer in range(LAYERS)
    )
    assert layered.parts_posted == 2 and layered.release(ticket.handle)
