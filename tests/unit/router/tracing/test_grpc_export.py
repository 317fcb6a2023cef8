"""The OTLP/gRPC exporter sends the lean encoder's bytes as they are: through the SDK's own export path (retries,
metadata, deadline), on a stub whose Export serializes nothing, kept across the SDK's reconnects."""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from router.tracing import context as w3c
from router.tracing import semconv
from router.tracing.grpc_export import EXPORT_METHOD, LeanGrpcSpanExporter, _BytesStub
from tests.unit.router.tracing.support import in_memory


class _Channel:
    """Records the method the stub registers."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, dict[str, Any]]] = []

    def unary_unary(self, method: str, **kwargs: Any) -> object:
        self.registered.append((method, kwargs))
        return object()


class _Client:
    """Takes Export calls as the SDK's export path makes them."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def Export(self, request: Any, metadata: Any, timeout: float) -> None:
        assert timeout > 0
        self.requests.append(request)


def _spans() -> list[Any]:
    tracing, exported = in_memory()
    trace = tracing.start(w3c.NO_HEADERS, "chat tiny", {semconv.REQUEST_ID: "r1"})
    leg = trace.leg(semconv.PREFILL_SPAN, attempt=1, pairing_id="p", worker="http://127.0.0.1:1")
    leg.end()
    trace.end("ok", status=200)
    return list(exported.get_finished_spans())


def test_the_stub_sends_bytes_as_they_are() -> None:
    channel = _Channel()
    _BytesStub(channel)
    [(method, kwargs)] = channel.registered
    assert method == EXPORT_METHOD
    assert kwargs["request_serializer"](b"\x0a\x00") == b"\x0a\x00"


def test_an_export_hands_the_encoders_bytes_to_grpc() -> None:
    exporter = LeanGrpcSpanExporter("http://127.0.0.1:9")
    try:
        assert isinstance(exporter._client, _BytesStub)
        client = _Client()
        exporter._client = client
        spans = _spans()
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        [request] = client.requests
        assert isinstance(request, bytes)  # no protobuf message made, none serialized again
        assert ExportTraceServiceRequest.FromString(request) == encode_spans(spans)
    finally:
        exporter.shutdown()


def test_a_reconnect_keeps_the_bytes_stub() -> None:
    exporter = LeanGrpcSpanExporter("http://127.0.0.1:9")
    try:
        first = exporter._client
        exporter._initialize_channel_and_stub()  # what the SDK does after UNAVAILABLE
        assert isinstance(exporter._client, _BytesStub) and exporter._client is not first
    finally:
        exporter.shutdown()
