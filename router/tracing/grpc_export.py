"""The OTLP/gRPC span exporter with kvpush's lean encoder (router/tracing/otlp_encode.py) in place of the SDK's.

Everything else is the SDK exporter's own: endpoint, headers, TLS, compression, timeout, retries and reconnects
from OTEL_EXPORTER_OTLP_*. Only the request is made differently: the encoder's bytes go onto the channel as they
are (the Export method's request serializer is the identity), where the SDK's stub would want a protobuf message:
parsing the bytes into one only for gRPC to serialize it again cost about 40 % of the export thread's CPU per span
(bench/ANALYSIS.md, tracing). The wire is the same Export call with the same message bytes (the tests decode
them). Imported only when tracing over gRPC is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan

from router.tracing.otlp_encode import Encoder
from router.tracing.trace import Span

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _as_is(request: bytes) -> bytes:
    return request


class _BytesStub:
    """TraceService's client with an Export that sends ExportTraceServiceRequest bytes as they are."""

    def __init__(self, channel: Any) -> None:
        self.Export = channel.unary_unary(
            EXPORT_METHOD,
            request_serializer=_as_is,
            response_deserializer=ExportTraceServiceResponse.FromString,
            _registered_method=True,
        )


class LeanGrpcSpanExporter(OTLPSpanExporter):
    TAKES_LEAN_SPANS = True  # the router's spans come as they were recorded (router/tracing/provider.py)

    def __init__(self, endpoint: str) -> None:
        self._encoder = Encoder()
        super().__init__(endpoint=endpoint)

    def _initialize_channel_and_stub(self) -> None:
        """The SDK's channel (made again on a reconnect), with the bytes stub in place of its own."""
        super()._initialize_channel_and_stub()  # type: ignore[no-untyped-call]
        self._client = _BytesStub(self._channel)  # type: ignore[assignment]

    def _translate_data(self, data: Sequence[ReadableSpan | Span]) -> bytes:  # type: ignore[override]
        return self._encoder.encode(data)
