"""A Tracing over the real OpenTelemetry SDK with an in-memory exporter (spans visible as soon as they end)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.tracing.provider import Tracing
from router.tracing.settings import ExportPlan, Sampling
from router.tracing.trace import Span


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


class LeanSpans(SpanExporter):
    """Keeps the router's spans as they were recorded (as kvpush's OTLP exporters get them)."""

    TAKES_LEAN_SPANS = True

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def export(self, spans: Sequence[Span]) -> SpanExportResult:  # type: ignore[override]
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def recorded(ratio: float = 1.0) -> tuple[Tracing, LeanSpans]:
    exporter = LeanSpans()
    return Tracing(plan(ratio), exporter, batch=False), exporter
