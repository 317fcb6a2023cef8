"""One request's spans over the real OTel SDK: parent from the client or a new root, leg spans whose headers name
them, the handoff event, outcomes, idempotent ends, the unsampled path (no child spans, flags off) and exemplars."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.provider import Tracing
from tests.unit.router.tracing.support import by_name, in_memory, plan

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
ATTRS = semconv.request_attributes(endpoint="chat", model="tiny", max_tokens=16, request_id="req-1")


def client(sampled: bool = True, state: tuple[tuple[str, str], ...] = ()) -> w3c.TraceHeaders:
    return w3c.TraceHeaders(w3c.ParentContext(TRACE, CLIENT_SPAN, sampled, state), "user=alice")


def leg_attrs(leg: str, attempt: int = 1) -> dict[str, Any]:
    port = 8100 if leg == "prefill" else 8200
    return {"attempt": attempt, "pairing_id": "p1", "worker": f"http://h:{port}"}


def test_a_request_without_a_parent_is_a_root_server_span() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, semconv.server_span_name("chat", "tiny"), ATTRS)
    trace.end("ok", status=200)
    (span,) = exported.get_finished_spans()
    assert span.name == "chat tiny" and span.kind is SpanKind.SERVER and span.parent is None
    assert span.attributes is not None
    assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "tiny"
    assert span.attributes[semconv.OUTCOME] == "ok" and semconv.ERROR_TYPE not in span.attributes
    assert span.status.status_code is StatusCode.UNSET
    assert span.resource.attributes["service.name"] == "kvpush-test"


def test_the_client_context_is_the_parent_and_reaches_both_legs() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(client(state=(("vendor", "x1"),)), "chat tiny", ATTRS)
    prefill = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill"))
    decode = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    for leg in (prefill, decode):
        parent = w3c.parse_traceparent(leg.headers["traceparent"].encode())
        assert parent is not None and parent.trace_id == TRACE and parent.sampled
        assert leg.headers["tracestate"] == "vendor=x1"
        assert leg.headers["baggage"] == "user=alice"
    prefill.end()
    decode.first_byte(0.002)
    decode.end()
    trace.end("ok")
    spans = by_name(exported.get_finished_spans())
    server = spans["chat tiny"][0]
    assert server.context is not None and server.parent is not None
    assert server.context.trace_id == TRACE and server.parent.span_id == CLIENT_SPAN and server.parent.is_remote
    for name, leg in ((semconv.PREFILL_SPAN, prefill), (semconv.DECODE_SPAN, decode)):
        (span,) = spans[name]
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert span.context is not None and leg.headers["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"
        assert span.attributes is not None and span.attributes[semconv.ATTEMPT] == 1
    (event,) = spans[semconv.DECODE_SPAN][0].events
    assert event.name == semconv.FIRST_BYTE_EVENT and dict(event.attributes or {}) == {semconv.HANDOFF_SECONDS: 0.002}
    assert spans[semconv.PREFILL_SPAN][0].attributes == {
        semconv.ATTEMPT: 1,
        semconv.GEN_AI_REQUEST_ID: "p1",
        semconv.SERVER_ADDRESS: "h",
        semconv.SERVER_PORT: 8100,
    }  # an "ok" leg adds nothing at its end


def test_a_failed_leg_and_request_carry_the_error_type() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    first = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill", 1))
    first.end("connect")
    second = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill", 2))
    second.end("timeout", status=504)
    trace.end("timeout", status=504, attributes={semconv.ATTEMPTS: 2})
    spans = by_name(exported.get_finished_spans())
    legs = {dict(s.attributes or {})[semconv.ATTEMPT]: s for s in spans[semconv.PREFILL_SPAN]}
    assert [dict(legs[n].attributes or {})[semconv.ERROR_TYPE] for n in (1, 2)] == ["connect", "timeout"]
    assert dict(legs[2].attributes or {})[semconv.HTTP_RESPONSE_STATUS_CODE] == 504
    assert all(s.status.status_code is StatusCode.ERROR for s in legs.values())
    server = spans["chat tiny"][0]
    assert server.attributes is not None and server.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 504
    assert server.attributes[semconv.ATTEMPTS] == 2 and server.status.status_code is StatusCode.ERROR


def test_a_client_that_left_is_not_an_error() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    leg.end(semconv.CLIENT_GONE)
    trace.end(semconv.CLIENT_GONE)
    for span in exported.get_finished_spans():
        assert span.status.status_code is StatusCode.UNSET
        assert span.attributes is not None and span.attributes[semconv.OUTCOME] == "client_gone"
        assert semconv.ERROR_TYPE not in span.attributes


def test_ends_are_idempotent_and_late_calls_do_nothing() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    leg.end("ok")
    leg.end("timeout")
    leg.first_byte()
    trace.end("ok")
    trace.end("internal")
    trace.annotate({semconv.ROUTE: "pull"})
    assert trace.ended
    spans = by_name(exported.get_finished_spans())
    assert len(spans) == 2 and not spans[semconv.DECODE_SPAN][0].events
    assert semconv.ERROR_TYPE not in (spans[semconv.DECODE_SPAN][0].attributes or {})
    server = dict(spans["chat tiny"][0].attributes or {})
    assert server[semconv.OUTCOME] == "ok" and semconv.ROUTE not in server


def test_the_first_byte_without_a_prefill_leg_has_no_handoff() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    leg.first_byte()
    leg.end()
    trace.end("ok")
    (event,) = by_name(exported.get_finished_spans())[semconv.DECODE_SPAN][0].events
    assert not event.attributes


def test_a_negative_handoff_is_zero() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    leg.first_byte(-0.5)  # decode's first byte came before prefill's answer
    leg.end()
    trace.end("ok")
    (event,) = by_name(exported.get_finished_spans())[semconv.DECODE_SPAN][0].events
    assert dict(event.attributes or {}) == {semconv.HANDOFF_SECONDS: 0.0}


def test_an_unsampled_request_makes_no_child_spans_and_turns_the_flag_off() -> None:
    tracing, exported = in_memory(ratio=0.0)
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    assert not trace.recording and trace.exemplar() is None
    prefill = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill"))
    decode = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    assert prefill is decode  # one shared, already ended leg: nothing is made per leg
    parent = w3c.parse_traceparent(prefill.headers["traceparent"].encode())
    assert parent is not None and not parent.sampled and parent.trace_id == trace.trace_id
    prefill.first_byte(0.1)
    prefill.end("connect")
    trace.end("ok")
    assert exported.get_finished_spans() == ()


def test_a_client_that_says_not_sampled_is_not_traced_and_keeps_its_trace_id() -> None:
    tracing, exported = in_memory(ratio=1.0)
    trace = tracing.start(client(sampled=False), "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode"))
    assert leg.headers["traceparent"].startswith(f"00-{TRACE:032x}-") and leg.headers["traceparent"].endswith("-00")
    trace.end("ok")
    assert exported.get_finished_spans() == ()


def test_a_sampled_client_is_traced_even_at_ratio_zero_parent_based() -> None:
    tracing, exported = in_memory(ratio=0.0)
    trace = tracing.start(client(sampled=True), "chat tiny", ATTRS)
    trace.end("ok")
    assert len(exported.get_finished_spans()) == 1


def test_the_exemplar_names_the_trace_and_the_server_span() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(client(), "chat tiny", ATTRS)
    exemplar = trace.exemplar()
    trace.end("ok")
    (span,) = exported.get_finished_spans()
    assert span.context is not None
    assert exemplar == {"trace_id": f"{TRACE:032x}", "span_id": f"{span.context.span_id:016x}"}
    assert sum(len(k) + len(v) for k, v in exemplar.items()) <= 128  # OpenMetrics' bound on exemplar labels


def test_shutdown_flushes_the_batch() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(plan(), exporter, batch=True)
    tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS).end("ok")
    tracing.shutdown()
    assert len(exporter.get_finished_spans()) == 1


def test_the_configured_ratio_decides_before_the_sdk_makes_a_span() -> None:
    tracing, exported = in_memory(ratio=0.5)
    traces = [tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS) for _ in range(2000)]
    for trace in traces:
        trace.end("ok")
    sampled = sum(t.recording for t in traces)
    assert 800 < sampled < 1200  # binomial(2000, 0.5): 10 standard deviations either side
    assert len(exported.get_finished_spans()) == sampled  # a dropped request made no span at all


def test_a_dropped_request_passes_the_client_s_trace_id_and_tracestate_on() -> None:
    tracing, exported = in_memory(ratio=1.0)
    trace = tracing.start(client(sampled=False, state=(("vendor", "x1"),)), "chat tiny", ATTRS)
    leg = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill"))
    parent = w3c.parse_traceparent(leg.headers["traceparent"].encode())
    assert parent is not None and parent.trace_id == TRACE and not parent.sampled and parent.span_id != CLIENT_SPAN
    assert leg.headers["tracestate"] == "vendor=x1" and leg.headers["baggage"] == "user=alice"
    trace.end("ok")
    assert exported.get_finished_spans() == ()


def test_an_unsampled_request_never_builds_its_server_span_s_name_or_attributes() -> None:
    described: list[int] = []

    def describe() -> tuple[str, semconv.Attributes]:
        described.append(1)
        return "chat tiny", dict(ATTRS)

    tracing, exported = in_memory(ratio=0.0)
    for _ in range(50):
        tracing.begin(w3c.NO_HEADERS, describe).end("ok")
    assert described == [] and exported.get_finished_spans() == ()
    tracing.begin(client(sampled=True), describe).end("ok")  # a sampled parent: described once, exported
    assert described == [1] and len(exported.get_finished_spans()) == 1


def test_spans_are_recorded_without_the_sdk_s_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's Tracer/Span (locks, attribute cleaning, context objects, processor hooks) cost several times the
    whole tree recorded lean; the processor and exporter still get the SDK's ReadableSpans."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the SDK's Tracer was used")

    monkeypatch.setattr(sdk_trace.Tracer, "start_span", refuse)
    monkeypatch.setattr(sdk_trace.Span, "__init__", refuse)
    tracing, exported = in_memory()
    trace = tracing.start(client(state=(("vendor", "x1"),)), "chat tiny", ATTRS)
    prefill = trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill"))
    prefill.end("connect")
    decode = trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode", 2))
    decode.first_byte(0.001)
    decode.end()
    trace.end("ok", status=200)
    spans = by_name(exported.get_finished_spans())
    assert sorted(spans) == sorted(["chat tiny", semconv.PREFILL_SPAN, semconv.DECODE_SPAN])
    server = spans["chat tiny"][0]
    assert all(isinstance(s, ReadableSpan) for group in spans.values() for s in group)
    assert server.context is not None and server.context.trace_state.to_header() == "vendor=x1"
    assert spans[semconv.PREFILL_SPAN][0].status.status_code is StatusCode.ERROR
    for span in (*spans[semconv.PREFILL_SPAN], *spans[semconv.DECODE_SPAN]):
        assert span.context is not None and span.context.trace_state.to_header() == "vendor=x1"
        assert span.end_time is not None and span.start_time is not None and span.end_time >= span.start_time


def test_a_configured_value_length_limit_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "3")
    tracing, exported = in_memory()
    tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS).end("ok")
    (span,) = exported.get_finished_spans()
    assert span.attributes is not None and span.attributes[semconv.REQUEST_ID] == "req"


def test_a_worker_s_address_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = semconv.address_of

    def counting(url: str) -> semconv.Attributes:
        parsed.append(url)
        return real(url)

    monkeypatch.setattr(semconv, "address_of", counting)
    tracing, exported = in_memory()
    for _ in range(5):
        trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
        trace.leg(semconv.PREFILL_SPAN, **leg_attrs("prefill")).end()
        trace.leg(semconv.DECODE_SPAN, **leg_attrs("decode")).end()
        trace.end("ok")
    assert sorted(parsed) == ["http://h:8100", "http://h:8200"]
    decode = by_name(exported.get_finished_spans())[semconv.DECODE_SPAN][-1]
    assert dict(decode.attributes or {})[semconv.SERVER_PORT] == 8200
