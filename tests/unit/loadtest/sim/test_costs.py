import dataclasses
import math
import random
from pathlib import Path

import pytest
import yaml

from connector.transfer.layout import block_runs
from loadtest.sim import costs
from loadtest.sim.profile import PROFILE_DIR, from_mapping, load

QWEN = load("qwen3-32b-h200")
ZERO = load("zero")


def test_qwen_profile_derives_public_numbers() -> None:
    assert QWEN.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # 256 KiB per token
    assert QWEN.flops_per_token == pytest.approx(2 * 32.8e9)
    assert QWEN.flops_per_s == pytest.approx(8 * 989e12 * 0.5)
    assert QWEN.net_bytes_per_s == pytest.approx(3.2e12 / 8 * 0.8)
    assert QWEN.descriptors_per_run == 128 and QWEN.blocks_per_run == 1.0  # no run longer than a block
    assert costs.descriptors(QWEN, 16384) == 1024 * 128


def test_transfer_is_bytes_over_bandwidth_plus_descriptor_cost() -> None:
    t = costs.transfer_time(QWEN, 16384)
    expect = 16384 * 262144 / QWEN.net_bytes_per_s + 1024 * 128 * QWEN.transfer_per_descriptor_s
    assert t == pytest.approx(expect)
    assert costs.setup_time(QWEN, 16384) == pytest.approx(1024 * 128 * QWEN.setup_per_descriptor_s)


def test_step_is_a_roofline_plus_overhead() -> None:
    decode = costs.step_time(QWEN, [], [1000])
    memory = (QWEN.weight_bytes + 1001 * QWEN.kv_bytes_per_token) / QWEN.mem_bytes_per_s
    assert decode == pytest.approx(QWEN.step_overhead_s + memory)  # small batches are memory-bound
    big = costs.step_time(QWEN, [(8192, 0)], [])
    assert big == pytest.approx(QWEN.step_overhead_s + costs.prefill_flops(QWEN, 8192, 0) / QWEN.flops_per_s)
    assert costs.step_time(QWEN, [], []) == 0.0
    assert costs.step_time(QWEN, [], [1000] * 32) > decode  # more sequences, more KV to read


def test_prefill_time_sums_its_chunks_and_grows_with_context() -> None:
    p = dataclasses.replace(QWEN, max_batched_tokens=4096)
    total = costs.prefill_time(p, 10000)
    chunks = [(4096, 0), (4096, 4096), (1808, 8192)]
    assert total == pytest.approx(sum(costs.step_time(p, [c], []) for c in chunks))
    assert costs.prefill_flops(p, 100, 5000) > costs.prefill_flops(p, 100, 0)


def test_zero_profile_costs_nothing() -> None:
    assert costs.prefill_time(ZERO, 16384) == 0.0
    assert costs.transfer_time(ZERO, 16384) == 0.0
    assert costs.step_time(ZERO, [(10, 0)], [5, 6]) == 0.0
    assert costs.api_time(ZERO, 100) == 0.0


def test_a_transfer_posts_one_descriptor_per_run_of_blocks_and_region() -> None:
    """16k tokens, 64 layers x K, V: 131,072 descriptors block by block, 128 when every block pair is consecutive
    on both sides (the descriptor bench's `consecutive` row), one per run and region in between."""
    consecutive = dataclasses.replace(QWEN, blocks_per_run=math.inf)
    assert costs.descriptors(consecutive, 16384) == 128
    assert costs.descriptors(dataclasses.replace(QWEN, blocks_per_run=4.0), 16384) == 256 * 128
    assert costs.descriptors(dataclasses.replace(QWEN, blocks_per_run=1.5), 16384) == 683 * 128  # rounded up
    assert costs.descriptors(consecutive, 0) == 0 and costs.runs(consecutive, 1) == 1
    runs = dataclasses.replace(QWEN, blocks_per_run=4.0)
    assert costs.setup_time(runs, 16384) == pytest.approx(256 * 128 * QWEN.setup_per_descriptor_s)
    assert costs.transfer_time(runs, 16384) < costs.transfer_time(QWEN, 16384)


@pytest.mark.parametrize("run", [1, 2, 3, 8])
def test_runs_count_what_the_connectors_block_runs_finds(run: int) -> None:
    """Block tables whose pairs come in runs of `run` consecutive on both sides, with gaps between runs: the
    simulator's count equals the connector's (connector.transfer.layout.block_runs, one descriptor per run)."""
    rng = random.Random(run)
    local: list[int] = []
    remote: list[int] = []
    lo, ro = 0, 10_000
    for _ in range(48):
        lo, ro = lo + rng.randint(2, 9), ro - rng.randint(run + 1, run + 9)  # never adjacent to the last run
        local += range(lo, lo + run)
        remote += range(ro, ro + run)
        lo += run
    profile = dataclasses.replace(QWEN, blocks_per_run=float(run))
    assert costs.runs(profile, len(local)) == block_runs(local, remote)[2].size == 48


def test_a_profile_may_state_its_runs_and_refuses_a_run_under_one_block(tmp_path: Path) -> None:
    doc = yaml.safe_load((PROFILE_DIR / "qwen3-32b-h200.yaml").read_text(encoding="utf-8"))
    doc["network"]["blocks_per_run"] = 2.5
    assert from_mapping(doc).blocks_per_run == 2.5
    doc["network"]["blocks_per_run"] = 0.5
    with pytest.raises(ValueError, match="blocks_per_run"):
        from_mapping(doc)
