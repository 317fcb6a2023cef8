"""The lean OTLP encoder writes what the SDK's encoder writes: both outputs parse to equal protobuf messages, for
the router's own spans and for spans with every field the encoder covers."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import TraceState

from router.tracing import context as w3c
from router.tracing import otlp_encode, semconv
from router.tracing.trace import Span
from tests.unit.router.tracing.support import in_memory, recorded


def same_as_sdk(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(otlp_encode.Encoder().encode(spans))
    theirs = encode_spans(spans)
    assert ours == theirs, f"ours:\n{ours}\n\nSDK's:\n{theirs}"


def test_one_encoder_keeps_encoding_the_same_way() -> None:
    tracing, exported = in_memory()
    encoder = otlp_encode.Encoder()
    for i in range(3):
        tracing.start(w3c.NO_HEADERS, "chat", {"kvpush.request.id": f"r{i}", "gen_ai.request.max_tokens": i}).end("ok")
        spans = exported.get_finished_spans()
        assert ExportTraceServiceRequest.FromString(encoder.encode(spans)) == encode_spans(spans)


def router_spans() -> list[Span]:
    """Two requests' spans (a root and a child of a client's context), each with a failed and a good leg, as
    kvpush's exporters get them."""
    tracing, exported = recorded()
    for parent in (w3c.NO_HEADERS, w3c.TraceHeaders(w3c.ParentContext(5, 6, True, (("k", "v"),)), None)):
        trace = tracing.start(
            parent, "chat tiny", semconv.request_attributes(endpoint="chat", model="t", max_tokens=3, request_id="r")
        )
        prefill = trace.leg(semconv.PREFILL_SPAN, attempt=1, pairing_id="p", worker="http://127.0.0.1:8100")
        prefill.end("status", status=500)
        decode = trace.leg(semconv.DECODE_SPAN, attempt=2, pairing_id="q", worker="http://127.0.0.1:8100")
        decode.first_byte(0.25)
        decode.end()
        usage = {"prompt_tokens": 7, "completion_tokens": 3}
        trace.end(
            "ok",
            status=200,
            attributes=semconv.end_attributes(route="push", attempts=2, pairing_id="q", transfer_id="t", usage=usage),
        )
    assert len(exported.spans) == 6
    return exported.spans


def test_the_router_s_spans_encode_as_the_sdk_encodes_them() -> None:
    spans = router_spans()
    ours = ExportTraceServiceRequest.FromString(otlp_encode.Encoder().encode(spans))
    theirs = encode_spans([span.readable() for span in spans])
    assert ours == theirs, f"ours:\n{ours}\n\nSDK's:\n{theirs}"
    same_as_sdk([span.readable() for span in spans])  # and their ReadableSpans through the generic path


def test_a_span_that_failed_without_a_description_encodes_as_the_sdk_encodes_it() -> None:
    spans = router_spans()
    spans[0].error = ""
    ours = ExportTraceServiceRequest.FromString(otlp_encode.Encoder().encode(spans))
    assert ours == encode_spans([span.readable() for span in spans])


def test_the_router_s_spans_are_recorded_and_encoded_without_sdk_span_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled request makes no SDK object per span (SpanContext, Event, Status, ReadableSpan: they were most of
    what recording cost), neither while it is served nor when kvpush's exporter encodes it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an SDK span object was made")

    monkeypatch.setattr(SpanContext, "__new__", refuse)
    monkeypatch.setattr(ReadableSpan, "__init__", refuse)
    monkeypatch.setattr(Status, "__init__", refuse)
    monkeypatch.setattr(sdk_trace.Event, "__init__", refuse)
    spans = router_spans()
    encoded = otlp_encode.Encoder().encode(spans)
    monkeypatch.undo()
    assert ExportTraceServiceRequest.FromString(encoded) == encode_spans([span.readable() for span in spans])


def test_every_covered_field_encodes_as_the_sdk_encodes_it() -> None:
    exporter = InMemorySpanExporter()
    providers = [TracerProvider(resource=Resource.create({"service.name": name, "n": 1})) for name in ("a", "b")]
    for provider in providers:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    linked = SpanContext(9, 10, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("x", "y")]))
    for i, provider in enumerate(providers):
        tracer = provider.get_tracer("scope-one", "1.2.3")
        other = provider.get_tracer("scope-two")
        parent = set_span_in_context(NonRecordingSpan(SpanContext(1, 2, is_remote=i == 0, trace_flags=TraceFlags(1))))
        span = tracer.start_span(
            "everything",
            parent,
            SpanKind.PRODUCER,
            {"s": "é", "b": False, "i": -3, "big": 2**62, "f": 1.5, "l": ["a", "b"], "li": [1, 2], "e": ""},
            links=[Link(linked, {"why": "because"})],
        )
        span.add_event("e1", {"k": 1})
        span.add_event("e2")
        span.set_status(Status(StatusCode.ERROR, "broken"))
        span.end()
        other.start_span("plain", kind=SpanKind.CONSUMER).end()
        other.start_span("ok", kind=SpanKind.INTERNAL).set_status(Status(StatusCode.OK))
    same_as_sdk(exporter.get_finished_spans())


def test_nothing_encodes_to_an_empty_request() -> None:
    assert otlp_encode.Encoder().encode([]) == b""


def test_an_attribute_seen_before_is_not_encoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    tracing, exported = in_memory()
    for _ in range(4):
        tracing.start(w3c.NO_HEADERS, "chat", {"gen_ai.operation.name": "chat", "kvpush.attempts": 1}).end("ok")
    spans = exported.get_finished_spans()
    encoder = otlp_encode.Encoder()
    first = encoder.encode(spans[:1])
    values: list[object] = []
    real = otlp_encode._any_value

    def counting(value: object) -> bytes | None:
        values.append(value)
        return real(value)

    monkeypatch.setattr(otlp_encode, "_any_value", counting)
    assert encoder.encode(spans[:1]) == first
    encoder.encode(spans)
    assert values == []  # every attribute (the resource's too) came from the cache
    assert ExportTraceServiceRequest.FromString(encoder.encode(spans)) == encode_spans(spans)


def test_equal_values_of_other_types_stay_apart() -> None:
    tracing, exported = in_memory()
    for value in (1, True, 1.0, "1", 1, True):
        tracing.start(w3c.NO_HEADERS, "chat", {"x": value}).end("ok")
    spans = exported.get_finished_spans()
    encoder = otlp_encode.Encoder()
    for k in range(len(spans)):
        assert ExportTraceServiceRequest.FromString(encoder.encode(spans[k:])) == encode_spans(spans[k:])


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp_encode, "_PAIR_CACHE_MAX", 8)
    tracing, exported = in_memory()
    for i in range(30):
        tracing.start(w3c.NO_HEADERS, "chat", {"kvpush.request.id": f"r{i}"}).end("ok")
    spans = exported.get_finished_spans()
    encoder = otlp_encode.Encoder()
    assert ExportTraceServiceRequest.FromString(encoder.encode(spans)) == encode_spans(spans)
    assert len(encoder._pairs) <= 8
