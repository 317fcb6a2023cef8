"""The spans the dispatcher makes over scripted workers (the real OTel SDK, in-memory exporter): one tree per
request for push, pull, the decode-only fallback, a bypass and a retry; the client leaving mid-stream; each leg's
traceparent names its own span; bad client traceparents give a new root; tracing changes nothing on the wire but
the trace headers."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from router.answer import JsonAnswer, StreamAnswer
from router.config import build_settings
from router.decider import Decider, Decision, NoDecider, Route, Turn
from router.dispatch import ClientRequest, Dispatcher
from router.domain import Endpoint
from router.errors import UpstreamStatus
from router.legs.httpx import HttpxLegs
from router.metrics import Metrics
from router.protocol import parse_request
from router.timings import TimingLog
from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.provider import Tracing
from router.workers.pool import Pool
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, hang, prefill_ok, status
from tests.unit.router.tracing.support import by_name, in_memory

P0 = "http://p0:8100,engine_id=p0,side_host=127.0.0.9,side_port=5600"
P1 = "http://p1:8100,engine_id=p1,side_port=5601"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}
CLIENT_TRACE, CLIENT_SPAN = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
PARENT = f"00-{CLIENT_TRACE:032x}-{CLIENT_SPAN:016x}-01".encode()


async def make(workers: FakeWorkers, decider: Decider | None = None, **settings: Any) -> Dispatcher:
    s = build_settings({"prefill": [P0], "decode": ["http://d0:8200"]}, settings)
    metrics, timings = Metrics(), TimingLog(100)
    pool = Pool((*s.prefill, *s.decode), metrics)
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    return Dispatcher(s, pool, HttpxLegs(client), metrics, timings, decider=decider)


def traced_call(
    dispatcher: Dispatcher,
    tracing: Tracing,
    body: dict[str, Any] = BODY,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> ClientRequest:
    info = parse_request(Endpoint.COMPLETIONS, body)
    attrs = semconv.request_attributes(endpoint="completions", model="tiny", max_tokens=3, request_id="client-1")
    trace = tracing.start(w3c.read(headers or []), "text_completion tiny", attrs)
    return ClientRequest(body=body, info=info, record=dispatcher.new_record("client-1", info), trace=trace)


async def relay(answer: StreamAnswer | JsonAnswer, events: int | None = None) -> list[bytes]:
    assert isinstance(answer, StreamAnswer)
    got: list[bytes] = []
    try:
        async for event in answer.events():
            got.append(event)
            if events is not None and len(got) == events:
                break  # the client leaves
    finally:
        await answer.aclose()
    return got


def tree(exported: InMemorySpanExporter) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    spans = by_name(exported.get_finished_spans())
    (server,) = spans.pop("text_completion tiny")
    return server, spans


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def assert_child(span: ReadableSpan, parent: ReadableSpan) -> None:
    assert span.parent is not None and parent.context is not None and span.context is not None
    assert span.parent.span_id == parent.context.span_id and span.context.trace_id == parent.context.trace_id


def leg_parent(seen_headers: httpx.Headers) -> w3c.ParentContext:
    parent = w3c.parse_traceparent(seen_headers["traceparent"].encode())
    assert parent is not None
    return parent


async def test_push_is_one_tree_and_each_leg_carries_its_own_span() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    dispatcher = await make(workers)
    call = traced_call(dispatcher, tracing, headers=[(b"traceparent", PARENT), (b"tracestate", b"v=1")])
    await relay(await dispatcher.handle(call))
    server, legs = tree(exported)
    assert server.parent is not None and server.parent.span_id == CLIENT_SPAN
    assert attrs(server)[semconv.ROUTE] == "push" and attrs(server)[semconv.OUTCOME] == "ok"
    assert attrs(server)[semconv.PAIRING_ID] == call.record.pairing_id
    for name, host in ((semconv.PREFILL_SPAN, "p0"), (semconv.DECODE_SPAN, "d0")):
        (span,) = legs[name]
        assert_child(span, server)
        (seen,) = workers.legs(host)
        parent = leg_parent(seen.headers)
        assert span.context is not None and parent.span_id == span.context.span_id and parent.trace_id == CLIENT_TRACE
        assert seen.headers["tracestate"] == "v=1"
        assert attrs(span)[semconv.ATTEMPT] == 1 and attrs(span)[semconv.GEN_AI_REQUEST_ID] == call.record.pairing_id
    (event,) = legs[semconv.DECODE_SPAN][0].events
    assert event.name == semconv.FIRST_BYTE_EVENT and semconv.HANDOFF_SECONDS in (event.attributes or {})


async def test_pull_runs_the_legs_one_after_the_other_in_one_tree() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(mode="pull"), "d0": decode_ok()})
    dispatcher = await make(workers, mode="pull")
    await relay(await dispatcher.handle(traced_call(dispatcher, tracing)))
    server, legs = tree(exported)
    assert server.parent is None and attrs(server)[semconv.ROUTE] == "pull"
    (prefill,), (decode,) = legs[semconv.PREFILL_SPAN], legs[semconv.DECODE_SPAN]
    assert prefill.end_time is not None and decode.start_time is not None and prefill.end_time <= decode.start_time


async def test_the_decode_only_fallback_has_only_a_decode_leg() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"d0": decode_ok()}, down={"p0"})
    dispatcher = await make(workers, fallback="decode-only")
    await relay(await dispatcher.handle(traced_call(dispatcher, tracing)))
    server, legs = tree(exported)
    assert set(legs) == {semconv.DECODE_SPAN}
    assert attrs(server)[semconv.ROUTE] == "decode-only"
    (event,) = legs[semconv.DECODE_SPAN][0].events
    assert not event.attributes  # no prefill leg: no handoff


class Bypass(NoDecider):
    def decide(self, turn: Turn, decodes: Any, prefills: Any, now: float) -> Decision:
        return Decision(Route.BYPASS, decodes[0].id, None)


async def test_a_bypass_has_only_a_decode_leg() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    dispatcher = await make(workers, decider=Bypass())
    await relay(await dispatcher.handle(traced_call(dispatcher, tracing)))
    server, legs = tree(exported)
    assert set(legs) == {semconv.DECODE_SPAN} and attrs(server)[semconv.ROUTE] == "bypass"
    assert not workers.legs("p0")


async def test_a_retry_is_a_new_leg_span_with_the_next_attempt_number() -> None:
    tracing, exported = in_memory()
    kv = asyncio.Event()
    workers = FakeWorkers({"p0": status(503), "p1": prefill_ok("p1", done=kv), "d0": decode_ok(kv=kv)})
    dispatcher = await make(workers, prefill=[P0, P1], prefill_policy="round-robin")
    await relay(await dispatcher.handle(traced_call(dispatcher, tracing)))
    server, legs = tree(exported)
    assert attrs(server)[semconv.ATTEMPTS] == 2 and attrs(server)[semconv.OUTCOME] == "ok"
    prefills = sorted(legs[semconv.PREFILL_SPAN], key=lambda s: attrs(s)[semconv.ATTEMPT])
    assert [attrs(s)[semconv.ATTEMPT] for s in prefills] == [1, 2]
    assert attrs(prefills[0])[semconv.ERROR_TYPE] == "status" and prefills[0].status.status_code is StatusCode.ERROR
    assert attrs(prefills[0])[semconv.HTTP_RESPONSE_STATUS_CODE] == 503
    assert semconv.ERROR_TYPE not in attrs(prefills[1])
    assert attrs(prefills[0])[semconv.GEN_AI_REQUEST_ID] != attrs(prefills[1])[semconv.GEN_AI_REQUEST_ID]
    decodes = legs[semconv.DECODE_SPAN]  # the first attempt's decode leg was cancelled with its prefill
    assert [attrs(s)[semconv.ATTEMPT] for s in sorted(decodes, key=lambda s: attrs(s)[semconv.ATTEMPT])][-1] == 2
    for span in (*prefills, *decodes):
        assert_child(span, server)


async def test_a_failed_request_ends_its_span_with_the_error() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": status(500), "d0": hang()})
    dispatcher = await make(workers, retries=0)
    with pytest.raises(UpstreamStatus):
        await dispatcher.handle(traced_call(dispatcher, tracing))
    server, legs = tree(exported)
    assert attrs(server)[semconv.ERROR_TYPE] == "status" and server.status.status_code is StatusCode.ERROR
    assert attrs(server)[semconv.HTTP_RESPONSE_STATUS_CODE] == 502
    (decode,) = legs[semconv.DECODE_SPAN]  # given up when prefill failed: cancelled, not an error of its own
    assert attrs(decode)[semconv.OUTCOME] == "cancelled" and decode.status.status_code is StatusCode.UNSET


async def test_a_client_leaving_mid_stream_ends_the_decode_leg_and_the_request() -> None:
    tracing, exported = in_memory()
    hold, closed = asyncio.Event(), asyncio.Event()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(tokens=5, hold=hold, closed=closed)})
    dispatcher = await make(workers)
    call = traced_call(dispatcher, tracing)
    answer = await dispatcher.handle(call)
    assert not exported.get_finished_spans() or all(
        s.name != semconv.DECODE_SPAN for s in exported.get_finished_spans()
    )
    await relay(answer, events=1)  # gone after the first event, while decode still holds the stream
    server, legs = tree(exported)
    assert attrs(server)[semconv.OUTCOME] == "client_gone" and server.status.status_code is StatusCode.UNSET
    (decode,) = legs[semconv.DECODE_SPAN]
    assert attrs(decode)[semconv.OUTCOME] == "client_gone"
    assert server.end_time is not None and decode.end_time is not None and decode.end_time <= server.end_time


@pytest.mark.parametrize("bad", [b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01", b"garbage", PARENT.upper()])
async def test_a_bad_client_traceparent_gives_a_new_root(bad: bytes) -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    dispatcher = await make(workers)
    await relay(await dispatcher.handle(traced_call(dispatcher, tracing, headers=[(b"traceparent", bad)])))
    server, _ = tree(exported)
    assert server.parent is None
    assert leg_parent(workers.legs("d0")[0].headers).trace_id == server.context.trace_id


async def test_without_tracing_the_legs_carry_no_trace_headers() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    dispatcher = await make(workers)
    info = parse_request(Endpoint.COMPLETIONS, BODY)
    call = ClientRequest(body=BODY, info=info, record=dispatcher.new_record("client-1", info))
    await relay(await dispatcher.handle(call))
    for seen in workers.seen:
        assert "traceparent" not in seen.headers and "baggage" not in seen.headers
