"""The notice-latency benchmark (``loadtest.micro.notices``) runs on real NIXL agents and the TCP side
channel, both progress models: a small configuration, so it cannot rot (figures in connector/README.md)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")


@pytest.mark.parametrize("progress", ["poll", "thread"])
def test_the_notice_bench_moves_blocks_with_either_progress_model(progress: str) -> None:
    from connector.options import Options
    from loadtest.micro.notices import measure

    out = measure(Options(progress=progress), blocks=2, block_len=256, repeat=1)
    assert out["median_ms"] > 0
