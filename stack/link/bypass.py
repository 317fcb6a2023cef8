"""The session-affinity decider's bypass threshold on a link, derived from the link (pure).

A decode-only bypass makes D compute a turn's uncached suffix itself: D's running decodes wait that long. The
other way, a push, costs the turn P's prefill of the suffix plus moving its KV over the link. The decider's
default, 256 tokens (router/deciders/session_affinity.py), is the stall accepted where moving KV costs
nothing (loopback). On a link the push costs more per token, so the stall worth accepting grows with it: the
threshold is the suffix D computes in the time a push of the base suffix takes,

    threshold = base x (prefill per token + transfer per token) / prefill per token
              = base x (1 + kv_bytes_per_token x 8 / goodput / prefill per token)

efa-like (transfer 3.8 % of a prefill) stays at the base (266), ethernet-100g-like doubles it (535),
ethernet-25g-like (the link is the bottleneck, 4.38 prefills per transfer) gives 1377. Measured on
ethernet-25g-like (bench/README.md, multiturn on the link): 256 missed issue 11's targets (run
20261204T175001Z), 1024 met them (20261204T175736Z).

The multiturn suite on a link calls `decider_options` once the link is calibrated (an option set by hand wins).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from stack.link.plan import LinkPlan

__all__ = ["BASE_TOKENS", "OPTION", "decider_options", "for_link", "threshold"]

BASE_TOKENS = 256  # the decider's default bypass_max_uncached_tokens: the loopback's
OPTION = "bypass_max_uncached_tokens"


def threshold(
    *, kv_bytes_per_token: float, goodput_bit_s: float | None, prefill_tokens_per_s: float, base: int = BASE_TOKENS
) -> int:
    """The bypass threshold in tokens for a link of `goodput_bit_s` (None: unshaped, moving KV costs nothing
    next to computing it) carrying `kv_bytes_per_token`, with P and D prefilling `prefill_tokens_per_s`."""
    if kv_bytes_per_token <= 0 or prefill_tokens_per_s <= 0 or base < 0:
        raise ValueError("need positive KV bytes per token and prefill rate, and base >= 0")
    if goodput_bit_s is not None and not goodput_bit_s > 0:
        raise ValueError(f"link goodput must be positive, got {goodput_bit_s}")
    if goodput_bit_s is None or math.isinf(goodput_bit_s):
        return base
    transfer_per_token = kv_bytes_per_token * 8 / goodput_bit_s
    prefill_per_token = 1.0 / prefill_tokens_per_s
    return round(base * (1 + transfer_per_token / prefill_per_token))


def for_link(plan: LinkPlan, prompt_tokens: int, base: int = BASE_TOKENS) -> int:
    """The threshold for a calibrated link: `plan` resolved on `prompt_tokens`-token prompts (its measured
    prefill and one prompt's KV bytes give the prefill rate and the KV bytes per token)."""
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be at least 1")
    goodput = None if plan.shaping is None else plan.shaping.goodput_bit_s
    return threshold(
        kv_bytes_per_token=plan.kv_bytes / prompt_tokens,
        goodput_bit_s=goodput,
        prefill_tokens_per_s=prompt_tokens / plan.prefill_s,
        base=base,
    )


def decider_options(
    options: Sequence[tuple[str, float]], plan: LinkPlan, prompt_tokens: int
) -> tuple[tuple[str, float], ...]:
    """`options` (the decider's, as the multiturn plan holds them) with the link's bypass threshold added,
    unless they already set one."""
    if any(key == OPTION for key, _ in options):
        return tuple(options)
    return (*options, (OPTION, float(for_link(plan, prompt_tokens))))
