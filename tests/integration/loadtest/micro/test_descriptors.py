"""The descriptor benchmark (``loadtest.micro.descriptors``) runs on real NIXL DRAM agents: a small
configuration, so it cannot rot; the figures at scale are in connector/README.md."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")


def test_the_descriptor_bench_runs_on_real_nixl_agents() -> None:
    from loadtest.micro.descriptors import PATTERNS, WAYS, markdown, run

    out = run(layers=3, kv=2, blocks=400, block_len=16, sizes=[512], repeat=2)
    assert (out["regions"], out["descriptors"]) == (6, 2400)
    for key in ("add_peer", "add_peer_notices_only", "local_prep", "local_prep_full_list", "add_peer_full_list"):
        assert out["peers"][key]["best_ms"] >= 0
    rows = {(r["pattern"], r["way"]): r for r in out["requests"]}
    assert set(rows) == {(p, w) for p in PATTERNS for w in WAYS}
    assert all(r["blocks"] == 32 and r["write_call_best_ms"] >= 0 for r in rows.values())
    posted = {key: r["descriptors"] for key, r in rows.items()}  # NIXL's own count of what it posted
    assert posted["consecutive", "per_block"] == posted["scattered", "write"] == 32 * 6, "one per (region, block)"
    assert posted["consecutive", "prepped"] == posted["consecutive", "run_lists"] == 6, "one run: one per region"
    assert posted["consecutive", "write"] == 6
    for pattern in ("mid_load", "mid_load_paired", "measured"):
        merged = {posted[pattern, way] for way in ("prepped", "run_lists", "write")}
        assert len(merged) == 1 and 6 <= merged.pop() < 32 * 6, "both merged ways post the same runs"
    assert posted["measured", "write"] > posted["mid_load_paired", "write"], "mostly single blocks: more runs"
    assert "| 512 | scattered |" in markdown(out["requests"])
