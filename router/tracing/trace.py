"""One client request's trace: its server span, one span per leg and attempt, the handoff, the end.

Spans are recorded lean, on the event loop: a recorded span (`Span`) is one slotted object holding what OTLP
carries (ids, name, kind, times, a plain attribute dict, events as tuples, an error description), with no SDK
object inside it: no `SpanContext`, `Event`, `Status` or `ReadableSpan` is made per span. An ended span goes as
it is to the span processor (`Recorder.on_end`: the SDK's BatchSpanProcessor, which queues it, bounded, for its
export thread); kvpush's OTLP exporters encode it straight from its fields (router/tracing/otlp_encode.py), and
any other exporter gets the SDK's `ReadableSpan` of it (`Span.readable`, router/tracing/provider.py). The SDK's
`Tracer`/`Span` (locks, attribute cleaning, context objects, processor hooks) cost about a third of the router's
CPU per request at 100 % sampling, and the SDK's span objects, made three times a request, most of what was left
(bench/ANALYSIS.md, tracing). The attributes are the router's own (router/tracing/semconv.py builds them with
checked types), so nothing needs cleaning; a configured attribute value length limit
(OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT) is applied when the span ends.

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
from collections.abc import Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event as SdkEvent
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.sampling import new_span_id
from router.tracing.semconv import Attributes

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
MAX_ADDRESSES = 1024  # workers' server.address/port kept parsed (a pool has a few; discovery may churn)
SERVER = 2  # a span's kind, as OTLP numbers it (Span.SpanKind)
CLIENT = 3
_KINDS = {SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}
Event = tuple[str, int, Attributes | None]  # a span event: name, time (ns since the epoch), attributes


class _Sampled:
    """All a span processor reads of an ended span before queueing it (`span.context.trace_flags.sampled`): the
    router records sampled spans only."""

    __slots__ = ()
    trace_flags = _SAMPLED


class Recorder:
    """What every recorded span shares: the resource, the scope, where an ended span goes (the span processor's
    `on_end`), the attribute value length limit, and the workers' parsed addresses."""

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        on_end: Callable[[Span], None],
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


class Span:
    """A span being recorded, then ended and handed over once (never again touched by the router: `LegSpan` and
    `RequestTrace` end it once). Its fields are OTLP's: `parent_id` 0 when it is a root; `trace_state` the
    request's W3C tracestate members; `events` None until one is added; `error` the status description of a span
    that failed (None: status unset)."""

    __slots__ = (
        "attrs",
        "end_time",
        "error",
        "events",
        "kind",
        "name",
        "parent_id",
        "parent_remote",
        "parent_sampled",
        "recorder",
        "span_id",
        "start_time",
        "trace_id",
        "trace_state",
    )
    context = _Sampled()  # what the SDK's batch span processor checks (class-wide: one object for all spans)

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        kind: int,
        trace_id: int,
        span_id: int,
        trace_state: tuple[tuple[str, str], ...],
        attributes: Attributes,
        parent_id: int = 0,
        parent_remote: bool = False,
        parent_sampled: bool = True,
    ) -> None:
        self.recorder = recorder
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = span_id
        self.trace_state = trace_state
        self.attrs = attributes
        self.parent_id = parent_id
        self.parent_remote = parent_remote
        self.parent_sampled = parent_sampled
        self.start_time = time.time_ns()
        self.end_time = 0
        self.events: list[Event] | None = None
        self.error: str | None = None

    def add_event(self, name: str, attributes: Attributes | None) -> None:
        event = (name, time.time_ns(), attributes)
        if self.events is None:
            self.events = [event]
        else:
            self.events.append(event)

    def finish(self) -> None:
        limit = self.recorder.max_value_chars
        if limit is not None:
            for key, value in self.attrs.items():
                if isinstance(value, str) and len(value) > limit:
                    self.attrs[key] = value[:limit]
        self.end_time = time.time_ns()
        self.recorder.on_end(self)

    def readable(self) -> ReadableSpan:
        """The same span as the SDK's ReadableSpan: for exporters other than kvpush's OTLP ones (an in-memory or a
        console exporter), made on the export thread."""
        state = TraceState(list(self.trace_state)) if self.trace_state else None
        context = SpanContext(self.trace_id, self.span_id, False, _SAMPLED, state)
        parent = None
        if self.parent_id:
            flags = _SAMPLED if self.parent_sampled else _NOT_SAMPLED
            parent = SpanContext(self.trace_id, self.parent_id, self.parent_remote, flags, state)
        status = Status(StatusCode.UNSET) if self.error is None else Status(StatusCode.ERROR, self.error)
        return ReadableSpan(
            name=self.name,
            context=context,
            parent=parent,
            resource=self.recorder.resource,
            attributes=self.attrs,
            events=[SdkEvent(name, attributes, at) for name, at, attributes in self.events or ()],
            links=(),
            kind=_KINDS[self.kind],
            status=status,
            start_time=self.start_time,
            end_time=self.end_time,
            instrumentation_scope=self.recorder.scope,
        )


def readable(spans: Sequence[ReadableSpan | Span]) -> list[ReadableSpan]:
    """The spans as the SDK's ReadableSpans: the router's own converted (`Span.readable`), any other as it is."""
    return [s.readable() if isinstance(s, Span) else s for s in spans]


class LegSpan:
    """One leg of one attempt. `headers` go on the leg's request (its traceparent names this span)."""

    __slots__ = ("_ended", "_span", "headers")

    def __init__(self, span: Span | None, headers: dict[str, str]) -> None:
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
                span.error = outcome
        span.finish()


class RequestTrace:
    """The server span of one client request and the factory of its leg spans; for a request that is not
    sampled, only the trace id and the one header dict its legs carry."""

    __slots__ = ("_baggage", "_ended", "_hex", "_recorder", "_span", "_state", "_unrecorded", "recording", "trace_id")

    def __init__(
        self,
        recorder: Recorder | None,
        span: Span | None,
        trace_id: int,
        state: tuple[tuple[str, str], ...],
        baggage: str | None,
        unrecorded: LegSpan | None = None,
        trace_hex: str | None = None,
    ) -> None:
        self._recorder = recorder
        self._span = span
        self.trace_id = trace_id
        # the id as every traceparent and exemplar of this request writes it (`trace_hex`: a caller's, already made)
        self._hex = f"{trace_id:032x}" if trace_hex is None else trace_hex
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
        span_id = new_span_id()
        attributes = semconv.leg_attributes(attempt=attempt, pairing_id=pairing_id, address=recorder.address(worker))
        span = Span(recorder, name, CLIENT, self.trace_id, span_id, self._state, attributes, server.span_id)
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
                span.error = outcome
            span.finish()

    @property
    def ended(self) -> bool:
        return self._ended

    def exemplar(self) -> dict[str, str] | None:
        """OpenMetrics exemplar labels naming this trace (trace_id, span_id), or None when it is not sampled:
        a metric point must not link to a trace the backend never received."""
        span = self._span
        if span is None:
            return None
        return {"trace_id": self._hex, "span_id": f"{span.span_id:016x}"}


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
    if parent is None:
        span = Span(recorder, name, SERVER, trace_id, new_span_id(), (), attributes)
        return RequestTrace(recorder, span, trace_id, (), headers.baggage)
    state = parent.trace_state
    span = Span(
        recorder, name, SERVER, trace_id, new_span_id(), state, attributes, parent.span_id, True, parent.sampled
    )
    return RequestTrace(recorder, span, trace_id, state, headers.baggage)


def dropped(headers: w3c.TraceHeaders, trace_id: int) -> RequestTrace:
    """A request the sampler dropped: no span; its legs carry `trace_id` (the client's, else a fresh one) under
    a fresh parent id, with the sampled flag off and the client's tracestate and baggage."""
    parent = headers.parent
    state = parent.trace_state if parent is not None else ()
    trace_hex = f"{trace_id:032x}"
    leg = LegSpan(None, w3c.leg_headers(trace_hex, new_span_id(), False, state, headers.baggage))
    return RequestTrace(None, None, trace_id, state, headers.baggage, leg, trace_hex)
