"""A Tracing over the real OpenTelemetry SDK with an in-memory exporter (spans visible as soon as they end)."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.tracing.provider import Tracing
from router.tracing.settings import ExportPlan, Sampling


def plan(ratio: float = 1.0, sampler: str = "parentbased_traceidratio") -> ExportPlan:
    return ExportPlan("http://127.0.0.1:4317", "grpc", Sampling(sampler, ratio), "kvpush-test")


def in_memory(ratio: float = 1.0, sampler: str = "parentbased_traceidratio") -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(plan(ratio, sampler), exporter, batch=False), exporter


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out
