"""The process's tracing: its own OpenTelemetry TracerProvider (never the global one), the sampler, the resource
and the OTLP exporter (gRPC or HTTP/protobuf) behind a batch span processor, built from a resolved ExportPlan.

The exporter is the I/O seam: `Tracing` takes any SpanExporter (tests pass an in-memory one and a synchronous
processor); `exporter_for` builds the OTLP one the plan names (imported only then, so a router with tracing off
never loads gRPC): over gRPC the SDK's exporter with kvpush's lean encoder (router/tracing/grpc_export.py), over
HTTP/protobuf the SDK's exporter as it is (its encoder costs about three times ours per span). The batch
processor exports from its own (daemon) thread; `shutdown` flushes what is queued and holds its caller for a
bounded time only.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

from router.tracing import context as w3c
from router.tracing import trace
from router.tracing.settings import GRPC, ExportPlan, Sampling

INSTRUMENTATION = "kvpush.router"
FLUSH_MILLIS = 2000  # the longest the flush before the SDK's shutdown waits for queued spans to go out
SHUTDOWN_SECONDS = 3.0  # the longest `shutdown` holds its caller


def sampler_for(sampling: Sampling) -> Sampler:
    """The SDK sampler an OTel sampler name stands for."""
    root: Sampler
    base = sampling.name.removeprefix("parentbased_")
    if base == "always_on":
        root = ALWAYS_ON
    elif base == "always_off":
        root = ALWAYS_OFF
    elif base == "traceidratio":
        root = TraceIdRatioBased(sampling.ratio)
    else:
        raise ValueError(f"unknown sampler {sampling.name!r}")
    return ParentBased(root) if sampling.name.startswith("parentbased_") else root


def exporter_for(plan: ExportPlan) -> SpanExporter:
    """The OTLP span exporter of the plan's protocol, sending to its endpoint (the rest from OTEL_EXPORTER_OTLP_*)."""
    if plan.protocol == GRPC:
        from router.tracing.grpc_export import LeanGrpcSpanExporter

        return LeanGrpcSpanExporter(plan.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=plan.endpoint)


class Tracing:
    """Starts request traces; owns the provider, its processor and exporter until `shutdown`."""

    def __init__(
        self,
        plan: ExportPlan,
        exporter: SpanExporter,
        *,
        batch: bool = True,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        resource = Resource.create({**(attributes or {}), SERVICE_NAME: plan.service_name})
        # The configured sampler decides in `start`, before the SDK makes anything; the SDK records what it is
        # given (ALWAYS_ON). shutdown_on_exit=False: no atexit hook that could hold the exit for the exporter.
        self._sampler = sampler_for(plan.sampling)
        self._ids = RandomIdGenerator()
        self._provider = TracerProvider(sampler=ALWAYS_ON, resource=resource, shutdown_on_exit=False)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer(INSTRUMENTATION)
        self.plan = plan

    def start(
        self, headers: w3c.TraceHeaders, name: str, attributes: Mapping[str, str | bool | int | float]
    ) -> trace.RequestTrace:
        """The request's trace. The configured sampler decides first, on the client's trace id (else a fresh one):
        a dropped request costs an id and one sampler call, not an SDK span (at 1 % sampling, the common case)."""
        parent = headers.parent
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        decision = self._sampler.should_sample(trace.parent_context(headers), trace_id, name)
        if decision.decision is not Decision.RECORD_AND_SAMPLE:
            return trace.dropped(self._tracer, headers, trace_id, self._ids.generate_span_id())
        return trace.start(self._tracer, headers, name, attributes)

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> bool:
        """Flushes queued spans and stops the exporter, waiting at most `timeout` seconds (an unreachable collector
        holds the SDK's own shutdown for its retries, seconds); False when it was still at it. Blocking: call it
        off the event loop. The SDK's threads are daemons, so what is left of it never holds the process's exit."""
        stopper = threading.Thread(target=self._stop, name="kvpush-tracing-shutdown", daemon=True)
        stopper.start()
        stopper.join(timeout)
        return not stopper.is_alive()

    def _stop(self) -> None:
        self._provider.force_flush(FLUSH_MILLIS)
        self._provider.shutdown()


def build(plan: ExportPlan | None) -> Tracing | None:
    """The process's tracing for a resolved plan (None: tracing is off, nothing is built)."""
    return None if plan is None else Tracing(plan, exporter_for(plan))
