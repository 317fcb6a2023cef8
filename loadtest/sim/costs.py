"""The cost model: pure functions from a Profile and a batch to seconds (step, transfer, setup)."""

import math
from collections.abc import Sequence

from loadtest.sim.profile import Profile


def _div(x: float, rate: float) -> float:
    return 0.0 if x == 0 or math.isinf(rate) else x / rate


def blocks(p: Profile, tokens: int) -> int:
    return math.ceil(tokens / p.block_size) if tokens > 0 else 0


def kv_bytes(p: Profile, tokens: int) -> float:
    return p.kv_bytes_per_token * tokens


def runs(p: Profile, num_blocks: int) -> int:
    """The runs of blocks consecutive on both sides among `num_blocks` (the connector posts one descriptor per run
    and region): `num_blocks / blocks_per_run` rounded up, at least one, at most one per block."""
    if num_blocks <= 0:
        return 0
    return min(num_blocks, max(1, math.ceil(num_blocks / p.blocks_per_run)))


def descriptors(p: Profile, tokens: int) -> int:
    """The descriptors a transfer of `tokens` tokens posts per rank: one per run of blocks and region."""
    return runs(p, blocks(p, tokens)) * p.descriptors_per_run


def prefill_flops(p: Profile, tokens: int, ctx_before: int) -> float:
    """A chunk of `tokens` new tokens after `ctx_before` already cached: dense + causal attention FLOPs."""
    pairs = tokens * ctx_before + tokens * (tokens + 1) / 2
    return p.flops_per_token * tokens + p.attn_flops_per_pair * pairs


def step_time(p: Profile, chunks: Sequence[tuple[int, int]], decode_ctx: Sequence[int]) -> float:
    """One engine step: roofline max(compute, memory) plus a fixed overhead; 0 for an empty step.

    chunks: (new tokens, context before) per prefill chunk; decode_ctx: context length per decoding sequence.
    Memory traffic: the weights once, plus the KV the step reads (every context it attends over).
    """
    if not chunks and not decode_ctx:
        return 0.0
    flops = sum(prefill_flops(p, t, c) for t, c in chunks)
    flops += sum(prefill_flops(p, 1, c) for c in decode_ctx)
    kv_read = sum(kv_bytes(p, c + t) for t, c in chunks) + sum(kv_bytes(p, c + 1) for c in decode_ctx)
    return p.step_overhead_s + max(_div(flops, p.flops_per_s), _div(p.weight_bytes + kv_read, p.mem_bytes_per_s))


def prefill_time(p: Profile, prompt: int) -> float:
    """A lone prompt through chunked prefill on an idle engine (the sum of its chunk steps)."""
    total, done = 0.0, 0
    while done < prompt:
        n = min(p.max_batched_tokens, prompt - done)
        total += step_time(p, [(n, done)], [])
        done += n
    return total


def transfer_time(p: Profile, tokens: int) -> float:
    """Moving one request's KV: bytes over the link plus a posting cost per descriptor."""
    return _div(kv_bytes(p, tokens), p.net_bytes_per_s) + descriptors(p, tokens) * p.transfer_per_descriptor_s


def setup_time(p: Profile, tokens: int) -> float:
    """Preparing one request's descriptor lists (pull: stalls D's engine step; push: P's writer thread)."""
    return descriptors(p, tokens) * p.setup_per_descriptor_s


def api_time(p: Profile, prompt: int) -> float:
    """API-server time before the engine sees a request (parse + tokenize), off the engine loop."""
    return p.api_fixed_s + p.api_per_token_s * prompt
