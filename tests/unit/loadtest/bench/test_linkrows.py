"""The link suite's pure decisions: step order, QPS caps, request counts, transfer times from histogram deltas,
KV bytes from D's sources, output agreement."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.bench import linkrows


def test_the_headline_step_comes_first_and_alone_carries_the_plans_qps_and_repeats() -> None:
    steps = linkrows.steps((1024, 4096), ("ethernet-100g-like", "efa-like"), (1.0, 3.0), 3, (1.0,), 1)
    assert [(s.input_len, s.preset, s.headline) for s in steps] == [
        (1024, "ethernet-100g-like", True),
        (1024, "efa-like", False),
        (4096, "ethernet-100g-like", False),
        (4096, "efa-like", False),
    ]
    assert steps[0].qps == (1.0, 3.0) and steps[0].repeats == 3
    assert all(s.qps == (1.0,) and s.repeats == 1 for s in steps[1:])


@pytest.mark.parametrize("args", [((), ("efa-like",), (1.0,), 1, (1.0,), 1), ((1024,), ("x",), (1.0,), 0, (1.0,), 1)])
def test_steps_refuse_an_empty_plan_or_no_repeats(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        linkrows.steps(*args)


def test_a_side_step_loads_the_busier_of_p_and_the_link_to_at_most_max_load() -> None:
    # a 25g-like link: the transfer is 4.38 prefills, so the link, not P, caps the load
    assert linkrows.capped_qps(1.0, 0.3, 1.314, 0.7) == pytest.approx(0.53)
    assert linkrows.capped_qps(1.0, 0.3, 0.01, 0.7) == 1.0  # P at 30 %: as asked
    assert linkrows.capped_qps(1.0, 1.2, None, 0.7) == pytest.approx(0.58)  # 4096 tokens: P caps it
    assert linkrows.capped_qps(0.2, 0.3, 1.314, 0.7) == 0.2
    with pytest.raises(ValueError):
        linkrows.capped_qps(1.0, 0.3, 0.1, 0.0)


def test_points_last_about_max_point_s_but_have_at_least_four_requests() -> None:
    assert linkrows.n_for(1.0, 16, 8.0) == 8
    assert linkrows.n_for(3.0, 16, 8.0) == 16
    assert linkrows.n_for(0.1, 16, 8.0) == 4
    assert linkrows.n_for(0.1, 16, 0.0) == 16


def test_the_transfer_time_is_the_mean_of_the_histogram_that_grew_most() -> None:
    before = {"p:vllm:kvpush_xfer_time_seconds": (1.0, 10.0), "d:vllm:nixl_xfer_time_seconds": (0.0, 0.0)}
    after = {"p:vllm:kvpush_xfer_time_seconds": (2.5, 20.0), "d:vllm:nixl_xfer_time_seconds": (0.4, 2.0)}
    got = linkrows.transfer_times(before, after)
    assert got == {"xfer_ms_mean": 150.0, "xfer_count": 10, "xfer_source": "p:vllm:kvpush_xfer_time_seconds"}
    assert linkrows.transfer_times({}, {})["xfer_ms_mean"] is None
    assert linkrows.transfer_times(after, after)["xfer_count"] == 0


def test_kv_bytes_are_the_external_tokens_times_the_bytes_per_token() -> None:
    assert linkrows.kv_bytes({"external_kv_transfer": 1024.0, "local_compute": 3.0}, 4096) == 4 * 2**20
    assert linkrows.kv_bytes(None, 4096) == 0


def test_outputs_agree_counts_equal_answers_and_a_missing_one_is_unequal() -> None:
    assert linkrows.outputs_agree(["a", "b"], ["a", None]) == [1, 2]
    assert linkrows.outputs_agree(["a", "b"], ["a", "b"]) == [2, 2]


def test_each_point_of_a_run_has_its_own_arrival_seed() -> None:
    seeds = {linkrows.point_seed(k, i) for k in range(6) for i in range(2)}
    assert len(seeds) == 12 and linkrows.point_seed(0, 0) == 4000
    with pytest.raises(ValueError):
        linkrows.point_seed(0, 10)


def test_the_connector_is_at_wire_speed_within_ten_percent_or_two_ms_of_bare_nixl() -> None:
    ok = linkrows.wire_verdict([0.152, 0.151, 0.160], [0.150, 0.149, 0.151])
    assert ok["wire_ok"] and ok["wire_connector_ms"] == 152.0 and ok["wire_bare_ms"] == 150.0
    assert ok["wire_ratio"] == pytest.approx(152 / 150, abs=1e-4)
    slow = linkrows.wire_verdict([0.170], [0.150])
    assert not slow["wire_ok"] and slow["wire_limit_ms"] == pytest.approx(165.0)
    small = linkrows.wire_verdict([0.0045], [0.003])  # 50 % over, but within 2 ms
    assert small["wire_ok"] and small["wire_limit_ms"] == pytest.approx(5.0)
    with pytest.raises(ValueError):
        linkrows.wire_verdict([], [0.1])
