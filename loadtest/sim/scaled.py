"""The simulator at the CPU bench's scale: a profile built from what a link run measured, and its predictions.

The seed profiles describe an H200 pair from public numbers; a link-suite row instead measured everything the
cost model needs: P's prefill time for the row's prompt (the link's calibration), the decode step (TPOT) and the
link's rate. `measured_profile` turns those into a Profile with one linear step cost (a step of k new tokens
takes a fixed overhead + k x a per-token cost: one prefill step is the measured prefill, a decode step the TPOT),
the bench model's KV (4 KiB per token, 128-token blocks, 2 x 4 layers regions: one descriptor per run of blocks
and region), P's write call per descriptor as the descriptor bench measured it on this box, and the link's goodput
as the network; `predict` runs the virtual-time pair (sim/pair.py) on it, so the
simulator's network and WRITE model can be compared with the measured handoff and TTFT row by row.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from loadtest.sim import pair
from loadtest.sim.link import tcp_start_s
from loadtest.sim.profile import Profile

FRAME_EFFICIENCY = 1448 / 1514  # TCP payload per 1500-byte frame (the shaper counts frames)
# P's write call per posted descriptor on this box (NIXL 1.5.1 DRAM agents, UCX over loopback: the handle and the
# posting), from `python -m loadtest.micro.descriptors` (bench/ANALYSIS.md, "simulator: P's write call per
# descriptor"). The writer thread pays it (sim/writes.stage), pull's READ on D's engine step.
WRITE_PER_DESCRIPTOR_S = 1.8e-6


@dataclass(frozen=True)
class Measured:
    """What a link row measured, in seconds and bit/s."""

    prefill_s: float  # P alone, one prompt of `prompt` tokens (the link's calibration median)
    step_s: float  # one decode step (the row's TPOT)
    rate_bit_s: float | None  # the shaper's rate (None: unshaped)
    prompt: int
    kv_bytes_per_token: int = 4096  # the bench model: 4 layers x 2 x 2 KV heads x 64 x float32
    block_size: int = 128  # vLLM CPU's block
    layers: int = 4
    notify_s: float = 0.001  # a side-channel message between the hosts (TCP on the veth, ~1 ms with Python)
    rtt_s: float = 40e-6  # the veth's round trip (research turn3-netem.md 3: 30-39 us p50); the presets add none
    shared: bool = True  # overlapping transfers share the link (sim/link.FairShare); False: one at a time
    write_per_descriptor_s: float = WRITE_PER_DESCRIPTOR_S
    blocks_per_run: float = 1.0  # mean run of blocks consecutive on both sides (1: every block its own descriptor)

    @property
    def start_s(self) -> float:
        """What each transfer pays before it runs at its share: a round trip plus slow start (link.tcp_start_s)."""
        if self.rate_bit_s is None:
            return 0.0
        return tcp_start_s(self.rtt_s, self.rate_bit_s * FRAME_EFFICIENCY / 8)


def measured_profile(m: Measured, chunk_tokens: int | None = None) -> Profile:
    """A profile whose lone prefill of `m.prompt` tokens takes `m.prefill_s` and whose decode step `m.step_s`;
    `chunk_tokens`: the prefill's step budget (progressive push), else the whole prompt in one step."""
    # a step of k tokens: overhead + k x per_token; k = 1 is the decode step, k = prompt the lone prefill
    per_token = max(m.prefill_s - m.step_s, 1e-6) / max(m.prompt - 1, 1)
    overhead = max(m.step_s - per_token, 0.0)
    net = math.inf if m.rate_bit_s is None else m.rate_bit_s * FRAME_EFFICIENCY / 8
    return Profile(
        name=f"measured-{m.prompt}",
        flops_per_token=1.0,
        attn_flops_per_pair=0.0,
        weight_bytes=0.0,
        kv_bytes_per_token=float(m.kv_bytes_per_token),
        flops_per_s=1.0 / per_token,
        mem_bytes_per_s=math.inf,
        step_overhead_s=overhead,
        max_batched_tokens=chunk_tokens or 1 << 20,
        max_seqs=256,
        block_size=m.block_size,
        kv_capacity_tokens=10**9,
        net_bytes_per_s=net,
        descriptors_per_run=2 * m.layers,
        transfer_per_descriptor_s=0.0,  # the write call posts (below); the link then moves the bytes
        setup_per_descriptor_s=m.write_per_descriptor_s,
        handshake_s=0.0,
        notify_s=m.notify_s,
        api_fixed_s=0.0,
        api_per_token_s=0.0,
        blocks_per_run=m.blocks_per_run,
    )


def poisson(qps: float, n: int, seed: int) -> list[float]:
    """`n` arrival times (s) of a Poisson process at `qps`, the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def predict(
    m: Measured,
    mode: str,
    qps: float,
    output_len: int,
    chunk_tokens: int | None = None,
    n: int = 200,
    warmup: int = 5,
    seeds: int = 1,
) -> pair.Scores:
    """The virtual pair's TTFT/handoff/TPOT for `mode` (pull, upstream-push, kvpush-push, kvpush-progressive).

    `n` arrivals, the first `warmup` not scored. A short measured point (a few requests at a QPS near
    saturation) never reaches the steady state a long run would queue into, so compare it with the mean over
    `seeds` runs of its own length: the TTFT and TPOT means are averaged, the handoff p50 is the median."""
    chunk = chunk_tokens if mode == "kvpush-progressive" else None
    profile = measured_profile(m, chunk)
    runs = [
        pair.run(
            profile, mode, poisson(qps, n, 7 + k), m.prompt, output_len, warmup, shared=m.shared, start_s=m.start_s
        )
        for k in range(seeds)
    ]
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if r.n > 0]
    hand = sorted(r.handoff_p50_ms for r in ok)
    return pair.Scores(
        mode=mode,
        qps=qps,
        n=sum(r.n for r in ok),
        ttft_mean_ms=sum(r.ttft_mean_ms for r in ok) / len(ok) if ok else math.nan,
        ttft_p50_ms=sorted(r.ttft_p50_ms for r in ok)[len(ok) // 2] if ok else math.nan,
        tpot_mean_ms=sum(r.tpot_mean_ms for r in ok) / len(ok) if ok else math.nan,
        handoff_p50_ms=hand[len(hand) // 2] if hand else math.nan,
        unfinished=sum(r.unfinished for r in runs),
    )


def predict_at(
    m: Measured, mode: str, arrivals: list[float], output_len: int, chunk_tokens: int | None = None
) -> pair.Scores:
    """The virtual pair on the exact send times of a measured point (seconds, any origin), every one scored."""
    chunk = chunk_tokens if mode == "kvpush-progressive" else None
    t0 = min(arrivals)
    times = sorted(t - t0 for t in arrivals)
    return pair.run(
        measured_profile(m, chunk), mode, times, m.prompt, output_len, warmup=0, shared=m.shared, start_s=m.start_s
    )
