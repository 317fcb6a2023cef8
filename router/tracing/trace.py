"""One client request's trace: its server span, one span per leg and attempt, the handoff, the end. Over the
OpenTelemetry API, with the tracer injected (router/tracing/provider.py builds it; tests give one with an
in-memory exporter).

Who ends what, once each (every `end` is idempotent, so an owner that ends twice by two paths is harmless):

- `RequestTrace` (the server span): ended by whoever finishes the request's timing record (the dispatcher's
  `_finish`): on a JSON answer, an error, a client that left, or when a stream ends (also cut or abandoned).
- `LegSpan`: ended by the leg that started it: a prefill leg when it answers or fails (a detached one on its own
  deadline, possibly after the request ended), a decode leg on failure, on a JSON answer, or when its stream closes.
- the handoff: an attribute of the decode leg's first-byte event (`LegSpan.first_byte`).

An unsampled request (`recording` false) makes no span at all (router/tracing/provider.py asks the configured
sampler before the SDK is called): its legs carry a `traceparent` with its trace id, a fresh parent id and the
sampled flag off, so the engines do not trace it either. With tracing off there is no `RequestTrace` (the callers
hold None).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.semconv import Attributes

_EMPTY = Context()


def parent_context(headers: w3c.TraceHeaders) -> Context:
    """The OTel context of the client's parent (a remote span), or an empty one: a new root."""
    parent = headers.parent
    if parent is None:
        return _EMPTY
    remote = SpanContext(
        trace_id=parent.trace_id,
        span_id=parent.span_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT),
        trace_state=TraceState(list(parent.trace_state)) if parent.trace_state else None,
    )
    return otel.set_span_in_context(NonRecordingSpan(remote), _EMPTY)


class LegSpan:
    """One leg of one attempt. `headers` go on the leg's request (its traceparent names this span)."""

    __slots__ = ("_ended", "_span", "headers")

    def __init__(self, span: otel.Span | None, headers: dict[str, str]) -> None:
        self._span = span
        self.headers = headers
        self._ended = span is None

    def first_byte(self, handoff: float | None = None) -> None:
        """Decode's first byte, now; `handoff`: seconds from the prefill leg's answer to it (clamped at 0)."""
        if not self._ended:
            attributes = None if handoff is None else {semconv.HANDOFF_SECONDS: max(0.0, handoff)}
            self._span.add_event(semconv.FIRST_BYTE_EVENT, attributes)  # type: ignore[union-attr]

    def end(self, outcome: str = semconv.OK, *, status: int | None = None) -> None:
        """Ends the leg (once): "ok", or the error kind that ended it (then the span's status is ERROR)."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        assert span is not None
        if outcome != semconv.OK:
            span.set_attributes(semconv.leg_failure_attributes(outcome, status=status))
            if outcome not in semconv.NOT_ERRORS:
                span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class RequestTrace:
    """The server span of one client request and the factory of its leg spans."""

    __slots__ = ("_baggage", "_context", "_ended", "_span", "_tracer", "_unrecorded", "recording")

    def __init__(self, tracer: otel.Tracer, span: otel.Span | SpanContext, baggage: str | None) -> None:
        """`span`: the server span, or, for a request the sampler dropped, the context its legs carry."""
        self._tracer = tracer
        self._baggage = baggage
        self._ended = False
        if isinstance(span, SpanContext):
            self._span: otel.Span = NonRecordingSpan(span)
            self.recording = False
        else:
            self._span = span
            self.recording = span.is_recording()
        self._context = otel.set_span_in_context(self._span, _EMPTY) if self.recording else _EMPTY
        self._unrecorded = None if self.recording else LegSpan(None, self._headers_for(self._span.get_span_context()))

    @property
    def trace_id(self) -> int:
        return self._span.get_span_context().trace_id

    def _headers_for(self, ctx: SpanContext) -> dict[str, str]:
        state = ctx.trace_state.items() if ctx.trace_state else ()
        return w3c.leg_headers(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled, state, self._baggage)

    def leg(self, name: str, *, attempt: int, pairing_id: str, worker: str) -> LegSpan:
        """A leg span (semconv.PREFILL_SPAN / DECODE_SPAN) started now, with the headers its request carries. An
        unsampled request builds nothing: every leg shares one ended LegSpan with the server span's headers."""
        if self._unrecorded is not None:
            return self._unrecorded
        attributes = semconv.leg_attributes(attempt=attempt, pairing_id=pairing_id, address=semconv.address_of(worker))
        span = self._tracer.start_span(name, self._context, SpanKind.CLIENT, attributes)
        return LegSpan(span, self._headers_for(span.get_span_context()))

    def annotate(self, attributes: Attributes) -> None:
        if self.recording and not self._ended:
            self._span.set_attributes(attributes)

    def end(self, outcome: str, *, status: int | None = None, attributes: Attributes | None = None) -> None:
        """Ends the server span with the request's outcome (once; later calls do nothing)."""
        if self._ended:
            return
        self._ended = True
        if self.recording:
            self._span.set_attributes(semconv.outcome_attributes(outcome, status=status))
            if attributes:
                self._span.set_attributes(attributes)
            if outcome not in semconv.NOT_ERRORS:
                self._span.set_status(Status(StatusCode.ERROR, outcome))
            self._span.end()

    @property
    def ended(self) -> bool:
        return self._ended

    def exemplar(self) -> dict[str, str] | None:
        """OpenMetrics exemplar labels naming this trace (trace_id, span_id), or None when it is not sampled:
        a metric point must not link to a trace the backend never received."""
        if not self.recording:
            return None
        ctx = self._span.get_span_context()
        return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def start(
    tracer: otel.Tracer, headers: w3c.TraceHeaders, name: str, attributes: Mapping[str, str | bool | int | float]
) -> RequestTrace:
    """The server span of a sampled request that arrived with `headers` (checked trace headers)."""
    span = tracer.start_span(name, parent_context(headers), SpanKind.SERVER, attributes)
    return RequestTrace(tracer, span, headers.baggage)


def dropped(tracer: otel.Tracer, headers: w3c.TraceHeaders, trace_id: int, span_id: int) -> RequestTrace:
    """A request the sampler dropped: no span; its legs carry `trace_id` (the client's, else a fresh one) under
    the fresh parent id `span_id`, with the sampled flag off and the client's tracestate."""
    parent = headers.parent
    state = TraceState(list(parent.trace_state)) if parent is not None and parent.trace_state else None
    context = SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.DEFAULT), trace_state=state
    )
    return RequestTrace(tracer, context, headers.baggage)
