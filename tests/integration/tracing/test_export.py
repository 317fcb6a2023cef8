"""The router's tracing through the real OTLP exporters (gRPC and HTTP/protobuf, batched) to a real receiver on
loopback: every span arrives once, decoded with opentelemetry-proto, with its parent links, resource and attributes;
the receiver itself decodes what an exporter sends."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

from loadtest.bench.otlp_sink import OtlpSink, SinkProcess
from router.tracing import context as w3c
from router.tracing import provider, semconv
from router.tracing.grpc_export import LeanGrpcSpanExporter
from router.tracing.http_export import LeanHttpSpanExporter
from router.tracing.settings import GRPC, HTTP, parse_tracing, resolve
from tests.integration.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.mark.parametrize("protocol", [GRPC, HTTP])
def test_one_request_arrives_as_a_tree(receiver: OtlpReceiver, protocol: str) -> None:
    endpoint = receiver.grpc_endpoint if protocol == GRPC else receiver.http_endpoint
    plan = resolve(parse_tracing({"endpoint": endpoint, "protocol": protocol, "service_name": "router-it"}), {})
    tracing = provider.build(plan)
    assert tracing is not None
    client = w3c.read([(b"traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01".encode())])
    attrs = semconv.request_attributes(endpoint="chat", model="tiny", max_tokens=4, request_id=f"r-{protocol}")
    trace = tracing.start(client, "chat tiny", attrs)
    legs = [
        trace.leg(name, attempt=1, pairing_id="p", worker="http://127.0.0.1:1")
        for name in (semconv.PREFILL_SPAN, semconv.DECODE_SPAN)
    ]
    legs[0].end()
    legs[1].first_byte(0.01)
    legs[1].end()
    trace.end("ok", status=200)
    tracing.shutdown()  # flushes the batch

    def mine(spans: list) -> list:  # type: ignore[type-arg]
        return [s for s in spans if s.trace_id == "ab" * 16 and s.via == ("grpc" if protocol == GRPC else "http")]

    got = mine(receiver.wait_for(lambda spans: len(mine(spans)) >= 3, f"3 spans over {protocol}", timeout=30))
    assert len(got) == 3
    by = {s.name: s for s in got}
    server = by["chat tiny"]
    assert server.kind == "server" and server.parent_span_id == "cd" * 8 and server.service == "router-it"
    assert server.attributes[semconv.REQUEST_ID] == f"r-{protocol}"
    for name in (semconv.PREFILL_SPAN, semconv.DECODE_SPAN):
        assert by[name].parent_span_id == server.span_id and by[name].kind == "client"
    assert by[semconv.PREFILL_SPAN].attributes[semconv.ATTEMPT] == 1
    assert by[semconv.DECODE_SPAN].events == (semconv.FIRST_BYTE_EVENT,)


def test_shutdown_with_the_collector_gone_is_bounded() -> None:
    plan = resolve(parse_tracing({"endpoint": "http://127.0.0.1:9", "protocol": GRPC}), {})  # nothing listens
    tracing = provider.build(plan)
    assert tracing is not None
    tracing.start(w3c.NO_HEADERS, "chat tiny", {}).end("ok")
    assert tracing.shutdown(timeout=0.5) is False  # the SDK still retries; the caller goes on


def _export_one_span(exporter: SpanExporter) -> None:
    """One span through the SDK's synchronous processor and `exporter`, then the exporter shut down."""
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("t").start_span("s").end()
    provider.shutdown()


def test_the_sink_takes_an_export_without_decoding_it() -> None:
    with OtlpSink() as sink:
        _export_one_span(LeanGrpcSpanExporter(sink.endpoint))
        assert sink.requests == 1 and sink.bytes > 0


def test_the_sink_takes_an_http_export_too() -> None:
    with SinkProcess() as sink:
        _export_one_span(LeanHttpSpanExporter(sink.http_endpoint))
    assert sink.requests == 1 and sink.bytes > 0


def test_the_suite_s_sink_runs_in_a_process_of_its_own() -> None:
    """The overhead suite's sink is not in the load generator's process (its gRPC threads took the client's GIL at
    each export, and made forking the routers started after it fail now and then); it still takes the exports."""
    with SinkProcess() as sink:
        assert sink.pid != os.getpid()
        _export_one_span(LeanGrpcSpanExporter(sink.endpoint))
    assert sink.requests == 1 and sink.bytes > 0
