"""The OTLP/HTTP exporter posts the lean encoder's bytes through the SDK's own HTTP client (headers, compression,
timeout, retries), and on this SDK it takes the lean path, not its fallback to the SDK's encoder."""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from router.tracing.http_export import LeanHttpSpanExporter
from tests.unit.router.tracing.test_grpc_export import _spans


class _Result:
    def __init__(self, success: bool) -> None:
        self.success = success


class _Client:
    """Takes export calls as the SDK's HTTP client does (bytes in, a result with `success` out)."""

    def __init__(self, success: bool = True) -> None:
        self.bodies: list[Any] = []
        self._success = success

    def export(self, data: Any) -> _Result:
        self.bodies.append(data)
        return _Result(self._success)

    def shutdown(self) -> None:
        return None


def _exporter(client: _Client) -> LeanHttpSpanExporter:
    exporter = LeanHttpSpanExporter("http://127.0.0.1:9/v1/traces")
    exporter._client.shutdown()
    exporter._client = client  # type: ignore[assignment]
    return exporter


def test_this_sdk_has_the_lean_path() -> None:
    exporter = LeanHttpSpanExporter("http://127.0.0.1:9/v1/traces")
    try:
        assert exporter.lean  # else every export would go through the SDK's encoder, three times the cost
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]


def test_an_export_posts_the_encoders_bytes() -> None:
    client = _Client()
    exporter = _exporter(client)
    spans = _spans()
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    [body] = client.bodies
    assert isinstance(body, bytes)  # the lean encoder's, no protobuf message made
    assert ExportTraceServiceRequest.FromString(body) == encode_spans(spans)


def test_a_failed_post_is_a_failed_export() -> None:
    exporter = _exporter(_Client(success=False))
    assert exporter.export(_spans()) == SpanExportResult.FAILURE


def test_after_shutdown_nothing_is_sent() -> None:
    client = _Client()
    exporter = _exporter(client)
    exporter.shutdown()  # type: ignore[no-untyped-call]
    assert exporter.export(_spans()) == SpanExportResult.FAILURE
    assert client.bodies == []
