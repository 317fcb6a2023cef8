"""The simulator at the bench's scale: a profile from a link row's measurements reproduces them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from loadtest.sim import costs
from loadtest.sim.scaled import WRITE_PER_DESCRIPTOR_S, Measured, measured_profile, poisson, predict, predict_at


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


def test_on_the_fair_share_link_two_pulls_at_once_each_take_two_wire_times() -> None:
    """Two prompts at once: their READs share the link (each ends after two wire times) instead of one after the
    other (the first after one); a lone READ takes one wire time (plus TCP's start: microseconds)."""
    m = Measured(prefill_s=0.05, step_s=0.005, rate_bit_s=1.2e8, prompt=1024)
    wire_ms = 1000 * 4 * 2**20 * 8 / (1.2e8 * 1448 / 1514)
    fifo = dataclasses.replace(m, shared=False)
    lone = predict_at(m, "pull", [0.0], 4)
    assert lone.handoff_p50_ms == pytest.approx(wire_ms + 5.0, abs=1.0)  # + D's step that makes the first token
    both, queued = predict_at(m, "pull", [0.0, 0.0], 4), predict_at(fifo, "pull", [0.0, 0.0], 4)
    # the second prefill ends 50 ms later, so the READs overlap for all but 50 ms of the first
    assert both.handoff_p50_ms > queued.handoff_p50_ms
    assert m.start_s == pytest.approx(40e-6) and Measured(0.1, 0.01, None, 8).start_s == 0.0


def test_ps_write_call_costs_the_measured_time_per_descriptor_on_the_writer() -> None:
    """1,024 tokens in 8 blocks of 128, 4 layers x K, V: 64 descriptors block by block, 8 when the blocks are one
    run on both sides; the write call (the writer thread, before the link) costs the bench's figure each."""
    m = Measured(prefill_s=0.3, step_s=0.009, rate_bit_s=1.2e8, prompt=1024)
    p = measured_profile(m)
    assert p.setup_per_descriptor_s == WRITE_PER_DESCRIPTOR_S and p.transfer_per_descriptor_s == 0.0
    assert costs.setup_time(p, 1024) == pytest.approx(64 * WRITE_PER_DESCRIPTOR_S)
    assert costs.descriptors(measured_profile(dataclasses.replace(m, blocks_per_run=math.inf)), 1024) == 8
    free = dataclasses.replace(m, write_per_descriptor_s=0.0)
    lone, unposted = predict_at(m, "kvpush-push", [0.0], 4), predict_at(free, "kvpush-push", [0.0], 4)
    assert lone.handoff_p50_ms - unposted.handoff_p50_ms == pytest.approx(1000 * 64 * WRITE_PER_DESCRIPTOR_S, abs=1e-6)
