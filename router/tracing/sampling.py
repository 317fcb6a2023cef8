"""The sampling decision, made once per request at its root, in pure code (no SDK call, no allocation).

The rule is the configured OTel sampler's (router/tracing/provider.py `sampler_for` builds the SDK's own; the
unit tests check the two agree): `parentbased_*` follows a client's parent (sampled parent: traced, unsampled
parent: not), and a root (or any request, without `parentbased_`) is traced when the low 64 bits of its trace id
fall below the ratio's bound, exactly as the SDK's `TraceIdRatioBased` decides (always_on: every id, always_off:
none). A request that is not sampled gets no span at all (router/tracing/trace.py `dropped`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from router.tracing.context import ParentContext
from router.tracing.settings import Sampling

_LOW64 = (1 << 64) - 1
_ALL = 1 << 64  # a bound above every 64-bit value: always sampled


@dataclass(frozen=True)
class Rule:
    """A sampler as data: follow the client's parent or not, and the bound a root's trace id is held to."""

    parent_based: bool
    bound: int  # a root is sampled when trace_id & (2**64 - 1) < bound


def rule_for(sampling: Sampling) -> Rule:
    """The rule of an OTel sampler name (settings.SAMPLERS) and its ratio."""
    base = sampling.name.removeprefix("parentbased_")
    if base == "always_on":
        bound = _ALL
    elif base == "always_off":
        bound = 0
    elif base == "traceidratio":
        bound = TraceIdRatioBased.get_bound_for_rate(sampling.ratio)
    else:
        raise ValueError(f"unknown sampler {sampling.name!r}")
    return Rule(sampling.name.startswith("parentbased_"), bound)


def sampled(rule: Rule, parent: ParentContext | None, trace_id: int) -> bool:
    """Whether the request with this trace id (its parent's, when it came with one) is traced."""
    if parent is not None and rule.parent_based:
        return parent.sampled
    return (trace_id & _LOW64) < rule.bound


def new_trace_id() -> int:
    """A random, valid (non-zero) 128-bit trace id, as the SDK's RandomIdGenerator makes them."""
    trace_id = random.getrandbits(128)
    while not trace_id:
        trace_id = random.getrandbits(128)
    return trace_id


def new_span_id() -> int:
    """A random, valid (non-zero) 64-bit span id."""
    span_id = random.getrandbits(64)
    while not span_id:
        span_id = random.getrandbits(64)
    return span_id
