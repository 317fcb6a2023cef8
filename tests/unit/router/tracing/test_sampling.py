"""The sampling rule decided in pure code agrees with the OpenTelemetry SDK's own samplers, for every sampler name,
ratio, and parent (none, sampled, not sampled)."""

from __future__ import annotations

import random

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from router.tracing import sampling
from router.tracing.context import ParentContext
from router.tracing.provider import sampler_for
from router.tracing.settings import SAMPLERS, Sampling


def sdk_decides(sampler: Sampling, parent: ParentContext | None, trace_id: int) -> bool:
    context = Context()
    if parent is not None:
        flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
        remote = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags)
        context = set_span_in_context(NonRecordingSpan(remote), context)
    result = sampler_for(sampler).should_sample(context, trace_id, "chat")
    return result.decision is Decision.RECORD_AND_SAMPLE


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("ratio", [0.0, 0.01, 0.5, 1.0])
def test_the_rule_agrees_with_the_sdk_sampler(name: str, ratio: float) -> None:
    rng = random.Random(f"{name}-{ratio}")
    sampler = Sampling(name, ratio)
    rule = sampling.rule_for(sampler)
    for _ in range(300):
        trace_id = rng.getrandbits(128) or 1
        for parent in (None, ParentContext(trace_id, 7, True), ParentContext(trace_id, 7, False)):
            assert sampling.sampled(rule, parent, trace_id) == sdk_decides(sampler, parent, trace_id)


def test_the_ratio_bound_is_the_sdk_s_at_its_edges() -> None:
    rule = sampling.rule_for(Sampling("traceidratio", 0.5))
    assert sampling.sampled(rule, None, (1 << 63) - 1) and not sampling.sampled(rule, None, 1 << 63)
    assert sampling.sampled(rule, None, (0xFFFF << 64) | 5)  # only the low 64 bits count


def test_an_unknown_sampler_is_refused() -> None:
    with pytest.raises(ValueError):
        sampling.rule_for(Sampling("sometimes"))


def test_fresh_ids_are_valid() -> None:
    assert all(0 < sampling.new_trace_id() < 1 << 128 for _ in range(100))
    assert all(0 < sampling.new_span_id() < 1 << 64 for _ in range(100))
