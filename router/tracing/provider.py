"""The process's tracing: the sampling rule, the resource and the OTLP exporter (gRPC or HTTP/protobuf) behind
the SDK's batch span processor, built from a resolved ExportPlan. No TracerProvider and no global state: spans are
recorded lean (router/tracing/trace.py) and handed to the processor when they end.

The exporter is the I/O seam: `Tracing` takes any SpanExporter (tests pass an in-memory one and a synchronous
processor); `exporter_for` builds the OTLP one the plan names (imported only then, so a router with tracing off
never loads gRPC): the SDK's exporter of the protocol with kvpush's lean encoder (router/tracing/grpc_export.py,
router/tracing/http_export.py; the SDK's encoder costs about three times ours per span), which take the router's
spans as they were recorded (`TAKES_LEAN_SPANS`); any other exporter is handed each span's SDK `ReadableSpan`,
made on the export thread (`ReadableSpans`). The batch
processor queues ended spans (bounded: OTEL_BSP_MAX_QUEUE_SIZE, 2048; beyond it spans are dropped, never the
request held) and exports them in batches (OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_SCHEDULE_DELAY) from its own
(daemon) thread, never the event loop's; `shutdown` flushes what is queued and holds its caller for a bounded time
only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from router.tracing import context as w3c
from router.tracing import sampling, trace
from router.tracing.semconv import Attributes
from router.tracing.settings import GRPC, ExportPlan, Sampling

INSTRUMENTATION = "kvpush.router"
FLUSH_MILLIS = 2000  # the longest the flush before the SDK's shutdown waits for queued spans to go out
SHUTDOWN_SECONDS = 3.0  # the longest `shutdown` holds its caller


def sampler_for(sampler: Sampling) -> Sampler:
    """The SDK sampler an OTel sampler name stands for (the reference router/tracing/sampling.py's rule agrees
    with, checked by the unit tests; the router decides with the rule)."""
    root: Sampler
    base = sampler.name.removeprefix("parentbased_")
    if base == "always_on":
        root = ALWAYS_ON
    elif base == "always_off":
        root = ALWAYS_OFF
    elif base == "traceidratio":
        root = TraceIdRatioBased(sampler.ratio)
    else:
        raise ValueError(f"unknown sampler {sampler.name!r}")
    return ParentBased(root) if sampler.name.startswith("parentbased_") else root


def exporter_for(plan: ExportPlan) -> SpanExporter:
    """The OTLP span exporter of the plan's protocol, sending to its endpoint (the rest from OTEL_EXPORTER_OTLP_*)."""
    if plan.protocol == GRPC:
        from router.tracing.grpc_export import LeanGrpcSpanExporter

        return LeanGrpcSpanExporter(plan.endpoint)
    from router.tracing.http_export import LeanHttpSpanExporter

    return LeanHttpSpanExporter(plan.endpoint)


class ReadableSpans(SpanExporter):
    """An exporter other than kvpush's OTLP ones (which encode the router's spans from their fields: their class
    says `TAKES_LEAN_SPANS`), handed the SDK's ReadableSpans: made on the export thread, off the event loop."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._exporter.export(trace.readable(spans))

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class Tracing:
    """Starts request traces; owns the span processor and its exporter until `shutdown`."""

    def __init__(
        self,
        plan: ExportPlan,
        exporter: SpanExporter,
        *,
        batch: bool = True,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        resource = Resource.create({**(attributes or {}), SERVICE_NAME: plan.service_name})
        self._rule = sampling.rule_for(plan.sampling)
        exporter = exporter if getattr(exporter, "TAKES_LEAN_SPANS", False) else ReadableSpans(exporter)
        self._processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        limits = SpanLimits()  # reads OTEL_(SPAN_)ATTRIBUTE_VALUE_LENGTH_LIMIT
        scope = InstrumentationScope(INSTRUMENTATION)
        # the SDK's processors read only `span.context.trace_flags` of a span before queueing it (trace.Span's)
        on_end: Callable[[trace.Span], None] = self._processor.on_end  # type: ignore[assignment]
        self._recorder = trace.Recorder(resource, scope, on_end, limits.max_span_attribute_length)
        self.plan = plan

    def start(
        self, headers: w3c.TraceHeaders, name: str, attributes: Mapping[str, str | bool | int | float]
    ) -> trace.RequestTrace:
        """The request's trace, its server span named `name` with `attributes` when it is sampled."""
        return self.begin(headers, lambda: (name, dict(attributes)))

    def begin(self, headers: w3c.TraceHeaders, describe: Callable[[], tuple[str, Attributes]]) -> trace.RequestTrace:
        """The request's trace. The sampling rule decides first, on the client's trace id (else a fresh one): a
        request that is not sampled costs an id and a comparison; `describe` (the server span's name and
        attributes) is called only for a sampled one."""
        parent = headers.parent
        trace_id = parent.trace_id if parent is not None else sampling.new_trace_id()
        if not sampling.sampled(self._rule, parent, trace_id):
            return trace.dropped(headers, trace_id)
        name, attributes = describe()
        return trace.start(self._recorder, headers, trace_id, name, attributes)

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> bool:
        """Flushes queued spans and stops the exporter, waiting at most `timeout` seconds (an unreachable collector
        holds the SDK's own shutdown for its retries, seconds); False when it was still at it. Blocking: call it
        off the event loop. The SDK's threads are daemons, so what is left of it never holds the process's exit."""
        stopper = threading.Thread(target=self._stop, name="kvpush-tracing-shutdown", daemon=True)
        stopper.start()
        stopper.join(timeout)
        return not stopper.is_alive()

    def _stop(self) -> None:
        self._processor.force_flush(FLUSH_MILLIS)
        self._processor.shutdown()


def build(plan: ExportPlan | None) -> Tracing | None:
    """The process's tracing for a resolved plan (None: tracing is off, nothing is built)."""
    return None if plan is None else Tracing(plan, exporter_for(plan))
