"""The simulator at the bench's scale: a profile from a link row's measurements reproduces them."""

from __future__ import annotations

import math

import pytest

from loadtest.sim import costs
from loadtest.sim.scaled import Measured, measured_profile, poisson, predict


def test_the_profile_prefills_in_the_measured_time_and_decodes_at_the_measured_step() -> None:
    m = Measured(prefill_s=0.3, step_s=0.009, rate_bit_s=1e8, prompt=1024)
    p = measured_profile(m)
    assert costs.prefill_time(p, 1024) == pytest.approx(0.3)
    assert costs.step_time(p, [], [100]) == pytest.approx(0.009, rel=1e-3)
    assert costs.transfer_time(p, 1024) == pytest.approx(4 * 2**20 * 8 / (1e8 * 1448 / 1514))
    assert measured_profile(m, 256).max_batched_tokens == 256
    assert math.isinf(measured_profile(Measured(0.3, 0.009, None, 1024)).net_bytes_per_s)


def test_at_a_light_load_pull_hands_off_in_about_the_wire_time_and_progressive_overlaps_it() -> None:
    m = Measured(prefill_s=0.3, step_s=0.009, rate_bit_s=1.2e8, prompt=1024)
    wire_ms = 1000 * 4 * 2**20 * 8 / (1.2e8 * 1448 / 1514)
    pull = predict(m, "pull", 0.2, 16)
    prog = predict(m, "kvpush-progressive", 0.2, 16, chunk_tokens=256)
    assert pull.unfinished == 0 and prog.unfinished == 0
    assert wire_ms <= pull.handoff_p50_ms <= wire_ms + 50
    assert prog.ttft_mean_ms < pull.ttft_mean_ms - 0.5 * wire_ms


def test_poisson_arrivals_start_at_zero_and_average_the_rate() -> None:
    ts = poisson(2.0, 2001, 1)
    assert ts[0] == 0.0 and ts == sorted(ts)
    assert ts[-1] / 2000 == pytest.approx(0.5, rel=0.1)


def test_a_short_points_prediction_averages_seeds_of_its_own_length() -> None:
    m = Measured(prefill_s=0.3, step_s=0.009, rate_bit_s=1.2e8, prompt=1024)
    long = predict(m, "pull", 2.5, 16)  # the link at ~73 %: a long run queues
    short = predict(m, "pull", 2.5, 16, n=9, warmup=1, seeds=20)
    assert short.n == 20 * 8 and short.unfinished == 0
    assert short.ttft_mean_ms < long.ttft_mean_ms
