import dataclasses

import pytest

from loadtest.sim import costs
from loadtest.sim.profile import load

QWEN = load("qwen3-32b-h200")
ZERO = load("zero")


def test_qwen_profile_derives_public_numbers() -> None:
    assert QWEN.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # 256 KiB per token
    assert QWEN.flops_per_token == pytest.approx(2 * 32.8e9)
    assert QWEN.flops_per_s == pytest.approx(8 * 989e12 * 0.5)
    assert QWEN.net_bytes_per_s == pytest.approx(3.2e12 / 8 * 0.8)
    assert QWEN.descriptors_per_block == 128
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
