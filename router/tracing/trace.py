"""One client request's trace: its server span, one span per leg and attempt, the handoff, the end.

Spans are recorded lean, on the event loop: a recorded span is an SDK `ReadableSpan` (the data the SDK's span
processors and OTLP exporters take) filled in place (a plain attribute dict, events, status, end time) and handed
as it is to the span processor (`Recorder.on_end`: the SDK's BatchSpanProcessor, which queues it, bounded, for its
export thread) when it ends. No SDK `Tracer`/`Span` is involved: their locks, attribute cleaning, context objects
and processor hooks cost about a third of the router's CPU per request at 100 % sampling (bench/README.md,
"Tracing overhead"). The attributes are the router's own (router/tracing/semconv.py builds them with checked
types), so nothing needs cleaning; a configured attribute value length limit (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT,
OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT) is applied when the span ends.

Who ends what, once each (every `end` is idempotent, so an owner that ends twice by two paths is harmless):

- `RequestTrace` (the server span): ended by whoever finishes the request's timing record (the dispatcher's
  `_finish`): on a JSON answer, an error, a client that left, or when a stream ends (also cut or abandoned).
- `LegSpan`: ended by the leg that started it: a prefill leg when it answers or fails (a detached one on its own
  deadline, possibly after the request ended), a decode leg on failure, on a JSON answer, or when its stream closes.
- the handoff: an attribute of the decode leg's first-byte event (`LegSpan.first_byte`).

An unsampled request (router/tracing/sampling.py decides at the root, before anything is built) makes no span,
no attributes and no context objects: its legs share one header dict, a `traceparent` with its trace id, a fresh
parent id and the sampled flag off, so the engines do not trace it either. With tracing off there is no
`RequestTrace` (the callers hold None).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.sampling import new_span_id
from router.tracing.semconv import Attributes

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSET = Status(StatusCode.UNSET)
MAX_ADDRESSES = 1024  # workers' server.address/port kept parsed (a pool has a few; discovery may churn)


class Recorder:
    """What every recorded span shares: the resource, the scope, where an ended span goes (the span processor's
    `on_end`), the attribute value length limit, and the workers' parsed addresses."""

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        on_end: Callable[[ReadableSpan], None],
        max_value_chars: int | None = None,
    ) -> None:
        self.resource = resource
        self.scope = scope
        self.on_end = on_end
        self.max_value_chars = max_value_chars
        self._addresses: dict[str, Attributes] = {}

    def address(self, url: str) -> Attributes:
        """`server.address`/`server.port` of a worker's URL, parsed once per worker."""
        found = self._addresses.get(url)
        if found is None:
            found = semconv.address_of(url)
            if len(self._addresses) >= MAX_ADDRESSES:
                self._addresses.clear()
            self._addresses[url] = found
        return found


class _Span(ReadableSpan):
    """A span being recorded: the SDK's ReadableSpan, filled in until it ends, then handed over (never again
    touched by the router: `LegSpan`/`RequestTrace` end it once). `LEAN_OTLP`: its attributes are a plain dict
    (nothing dropped) and it has no links, so router/tracing/otlp_encode.py reads its fields directly."""

    LEAN_OTLP = True

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: Attributes,
    ) -> None:
        # ReadableSpan's fields, set as its __init__ sets them (not called: a span is made three times a request,
        # and the call with thirteen arguments was a tenth of the recording's cost); the tests check every
        # property an exporter reads against the SDK's encoder and exporters.
        self.attrs = attributes  # the same dict and list the ReadableSpan shows
        self.event_list: list[Event] = []
        self._recorder = recorder
        self._name = name
        self._context = context
        self._kind = kind
        self._instrumentation_info = None
        self._instrumentation_scope = recorder.scope
        self._parent = parent
        self._start_time = time.time_ns()
        self._end_time = None
        self._attributes = attributes
        self._events = self.event_list
        self._links = ()
        self._resource = recorder.resource
        self._status = _UNSET

    def add_event(self, name: str, attributes: Attributes | None) -> None:
        self.event_list.append(Event(name, attributes, time.time_ns()))

    def set_error(self, outcome: str) -> None:
        self._status = Status(StatusCode.ERROR, outcome)

    def finish(self) -> None:
        limit = self._recorder.max_value_chars
        if limit is not None:
            for key, value in self.attrs.items():
                if isinstance(value, str) and len(value) > limit:
                    self.attrs[key] = value[:limit]
        self._end_time = time.time_ns()
        self._recorder.on_end(self)


class LegSpan:
    """One leg of one attempt. `headers` go on the leg's request (its traceparent names this span)."""

    __slots__ = ("_ended", "_span", "headers")

    def __init__(self, span: _Span | None, headers: dict[str, str]) -> None:
        self._span = span
        self.headers = headers
        self._ended = span is None

    def first_byte(self, handoff: float | None = None) -> None:
        """Decode's first byte, now; `handoff`: seconds from the prefill leg's answer to it (clamped at 0)."""
        span = self._span
        if not self._ended and span is not None:
            attributes: Attributes | None = None if handoff is None else {semconv.HANDOFF_SECONDS: max(0.0, handoff)}
            span.add_event(semconv.FIRST_BYTE_EVENT, attributes)

    def end(self, outcome: str = semconv.OK, *, status: int | None = None) -> None:
        """Ends the leg (once): "ok", or the error kind that ended it (then the span's status is ERROR)."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        assert span is not None
        if outcome != semconv.OK:
            span.attrs.update(semconv.leg_failure_attributes(outcome, status=status))
            if outcome not in semconv.NOT_ERRORS:
                span.set_error(outcome)
        span.finish()


class RequestTrace:
    """The server span of one client request and the factory of its leg spans; for a request that is not
    sampled, only the trace id and the one header dict its legs carry."""

    __slots__ = ("_baggage", "_ended", "_hex", "_recorder", "_span", "_state", "_unrecorded", "recording", "trace_id")

    def __init__(
        self,
        recorder: Recorder | None,
        span: _Span | None,
        trace_id: int,
        state: tuple[tuple[str, str], ...],
        baggage: str | None,
        unrecorded: LegSpan | None = None,
    ) -> None:
        self._recorder = recorder
        self._span = span
        self.trace_id = trace_id
        self._hex = f"{trace_id:032x}"  # the id as every traceparent and exemplar of this request writes it
        self._state = state
        self._baggage = baggage
        self._ended = False
        self.recording = span is not None
        self._unrecorded = unrecorded

    def leg(self, name: str, *, attempt: int, pairing_id: str, worker: str) -> LegSpan:
        """A leg span (semconv.PREFILL_SPAN / DECODE_SPAN) started now, with the headers its request carries. An
        unsampled request builds nothing: every leg shares one ended LegSpan with the request's headers."""
        server, recorder = self._span, self._recorder
        if server is None or recorder is None:
            assert self._unrecorded is not None
            return self._unrecorded
        parent = server.context
        assert parent is not None
        span_id = new_span_id()
        context = SpanContext(self.trace_id, span_id, False, _SAMPLED, parent.trace_state)
        attributes = semconv.leg_attributes(attempt=attempt, pairing_id=pairing_id, address=recorder.address(worker))
        span = _Span(recorder, name, context, parent, SpanKind.CLIENT, attributes)
        return LegSpan(span, w3c.leg_headers(self._hex, span_id, True, self._state, self._baggage))

    def annotate(self, attributes: Attributes) -> None:
        if self._span is not None and not self._ended:
            self._span.attrs.update(attributes)

    def end(self, outcome: str, *, status: int | None = None, attributes: Attributes | None = None) -> None:
        """Ends the server span with the request's outcome (once; later calls do nothing)."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        if span is not None:
            span.attrs.update(semconv.outcome_attributes(outcome, status=status))
            if attributes:
                span.attrs.update(attributes)
            if outcome not in semconv.NOT_ERRORS:
                span.set_error(outcome)
            span.finish()

    @property
    def ended(self) -> bool:
        return self._ended

    def exemplar(self) -> dict[str, str] | None:
        """OpenMetrics exemplar labels naming this trace (trace_id, span_id), or None when it is not sampled:
        a metric point must not link to a trace the backend never received."""
        span = self._span
        if span is None or span.context is None:
            return None
        return {"trace_id": self._hex, "span_id": f"{span.context.span_id:016x}"}


def _trace_state(state: tuple[tuple[str, str], ...]) -> TraceState | None:
    return TraceState(list(state)) if state else None


def start(
    recorder: Recorder,
    headers: w3c.TraceHeaders,
    trace_id: int,
    name: str,
    attributes: Attributes,
) -> RequestTrace:
    """The server span of a sampled request that arrived with `headers` (checked trace headers): a child of the
    client's parent (a remote span), else a root of `trace_id`. The span keeps `attributes` (the caller's own dict)."""
    parent = headers.parent
    state = parent.trace_state if parent is not None else ()
    trace_state = _trace_state(state)
    remote = None
    if parent is not None:
        flags = _SAMPLED if parent.sampled else _NOT_SAMPLED
        remote = SpanContext(parent.trace_id, parent.span_id, True, flags, trace_state)
    context = SpanContext(trace_id, new_span_id(), False, _SAMPLED, trace_state)
    span = _Span(recorder, name, context, remote, SpanKind.SERVER, attributes)
    return RequestTrace(recorder, span, trace_id, state, headers.baggage)


def dropped(headers: w3c.TraceHeaders, trace_id: int) -> RequestTrace:
    """A request the sampler dropped: no span; its legs carry `trace_id` (the client's, else a fresh one) under
    a fresh parent id, with the sampled flag off and the client's tracestate and baggage."""
    parent = headers.parent
    state = parent.trace_state if parent is not None else ()
    leg = LegSpan(None, w3c.leg_headers(f"{trace_id:032x}", new_span_id(), False, state, headers.baggage))
    return RequestTrace(None, None, trace_id, state, headers.baggage, leg)
