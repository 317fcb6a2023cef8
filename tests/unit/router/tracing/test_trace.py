"""One request's spans over the real OTel SDK: parent from the client or a new root, leg spans whose headers name
them, the handoff, outcomes, idempotent ends, the unsampled path (no child spans, flags off) and exemplars."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.provider import Tracing
from tests.unit.router.tracing.support import by_name, in_memory, plan

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
ATTRS = semconv.request_attributes(
    endpoint="chat", model="tiny", stream=True, max_tokens=16, request_id="req-1", mode="push"
)


def client(sampled: bool = True, state: tuple[tuple[str, str], ...] = ()) -> w3c.TraceHeaders:
    return w3c.TraceHeaders(w3c.ParentContext(TRACE, CLIENT_SPAN, sampled, state), "user=alice")


def leg_attrs(leg: str, attempt: int = 1) -> semconv.Attributes:
    return semconv.leg_attributes(
        leg=leg, attempt=attempt, worker="http://127.0.0.1:8100", pairing_id="p1", transfer_id="t1", route="push"
    )


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
    prefill = trace.leg(semconv.PREFILL_SPAN, leg_attrs("prefill"))
    decode = trace.leg(semconv.DECODE_SPAN, leg_attrs("decode"))
    for leg in (prefill, decode):
        parent = w3c.parse_traceparent(leg.headers["traceparent"].encode())
        assert parent is not None and parent.trace_id == TRACE and parent.sampled
        assert leg.headers["tracestate"] == "vendor=x1"
        assert leg.headers["baggage"] == "user=alice"
    prefill.end()
    decode.first_byte()
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
    assert [e.name for e in spans[semconv.DECODE_SPAN][0].events] == [semconv.FIRST_BYTE_EVENT]


def test_a_failed_leg_and_request_carry_the_error_type() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    first = trace.leg(semconv.PREFILL_SPAN, leg_attrs("prefill", 1))
    first.end("connect")
    second = trace.leg(semconv.PREFILL_SPAN, leg_attrs("prefill", 2))
    second.end("timeout", status=504)
    trace.end("timeout", status=504, attributes={semconv.ATTEMPTS: 2})
    spans = by_name(exported.get_finished_spans())
    legs = {dict(s.attributes or {})[semconv.ATTEMPT]: s for s in spans[semconv.PREFILL_SPAN]}
    assert [dict(legs[n].attributes or {})[semconv.ERROR_TYPE] for n in (1, 2)] == ["connect", "timeout"]
    assert all(s.status.status_code is StatusCode.ERROR for s in legs.values())
    server = spans["chat tiny"][0]
    assert server.attributes is not None and server.attributes[semconv.HTTP_RESPONSE_STATUS_CODE] == 504
    assert server.attributes[semconv.ATTEMPTS] == 2 and server.status.status_code is StatusCode.ERROR


def test_a_client_that_left_is_not_an_error() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, leg_attrs("decode"))
    leg.end(semconv.CLIENT_GONE)
    trace.end(semconv.CLIENT_GONE)
    for span in exported.get_finished_spans():
        assert span.status.status_code is StatusCode.UNSET
        assert span.attributes is not None and span.attributes[semconv.OUTCOME] == "client_gone"


def test_ends_are_idempotent_and_late_calls_do_nothing() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, leg_attrs("decode"))
    leg.end("ok")
    leg.end("timeout")
    leg.first_byte()
    trace.end("ok")
    trace.end("internal")
    trace.annotate({semconv.ROUTE: "pull"})
    trace.handoff(0.1, {})
    assert trace.ended
    spans = exported.get_finished_spans()
    assert len(spans) == 2
    assert all(s.attributes is not None and s.attributes[semconv.OUTCOME] == "ok" for s in spans)


def test_the_handoff_is_a_span_ending_now_that_lasted_the_given_time() -> None:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    trace.handoff(0.25, {semconv.ATTEMPT: 1})
    trace.handoff(-0.5, {semconv.ATTEMPT: 2})  # decode's first byte before prefill's answer: zero
    trace.end("ok")
    spans = by_name(exported.get_finished_spans())
    first, second = spans[semconv.HANDOFF_SPAN]
    assert first.end_time is not None and first.start_time is not None
    assert first.end_time - first.start_time == 250_000_000
    assert second.end_time == second.start_time
    assert first.attributes is not None and first.attributes[semconv.HANDOFF_SECONDS] == 0.25
    server = spans["chat tiny"][0]
    assert first.parent is not None and server.context is not None and first.parent.span_id == server.context.span_id


def test_an_unsampled_request_makes_no_child_spans_and_turns_the_flag_off() -> None:
    tracing, exported = in_memory(ratio=0.0)
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", ATTRS)
    assert not trace.recording and trace.exemplar() is None
    prefill = trace.leg(semconv.PREFILL_SPAN, leg_attrs("prefill"))
    decode = trace.leg(semconv.DECODE_SPAN, leg_attrs("decode"))
    assert prefill is decode  # one shared, already ended leg: nothing is made per leg
    parent = w3c.parse_traceparent(prefill.headers["traceparent"].encode())
    assert parent is not None and not parent.sampled and parent.trace_id == trace.trace_id
    prefill.end("connect")
    trace.handoff(0.1, {})
    trace.end("ok")
    assert exported.get_finished_spans() == ()


def test_a_client_that_says_not_sampled_is_not_traced_and_keeps_its_trace_id() -> None:
    tracing, exported = in_memory(ratio=1.0)
    trace = tracing.start(client(sampled=False), "chat tiny", ATTRS)
    leg = trace.leg(semconv.DECODE_SPAN, leg_attrs("decode"))
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
