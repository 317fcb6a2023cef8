"""The descriptor benchmark (``loadtest.micro.descriptors``) runs on real NIXL DRAM agents: a small
configuration, so it cannot rot; the figures at scale are in connector/README.md."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")


def test_the_descriptor_bench_runs_on_real_nixl_agents() -> None:
    from loadtest.micro.descriptors import run

    out = run(layers=3, blocks=200, block_len=16, tokens=512, repeat=2)
    assert (out["descriptors"], out["request_blocks"], out["request_descriptors"]) == (600, 32, 96)
    for key in ("add_peer", "add_peer_notices_only", "local_prep", "request_indices", "request_write_call"):
        assert out[key]["best_ms"] >= 0
