"""The OTLP/HTTP (protobuf) span exporter with kvpush's lean encoder (router/tracing/otlp_encode.py) in place of
the SDK's.

Everything else is the SDK exporter's own: endpoint, headers, TLS, compression, timeout and retries from
OTEL_EXPORTER_OTLP_*, and its HTTP client (a `requests` session: no threads of its own, where gRPC's C core keeps
poller threads awake in the process). Only the body is made differently: the SDK's encoder builds a protobuf
object per span, attribute and value, about three times the lean encoder's cost per span. The body is the same
ExportTraceServiceRequest (the tests decode it).

The SDK's export path is private API: `_client.export(bytes)` (opentelemetry-exporter-otlp-proto-http 1.45).
Where an SDK lacks it, `export` is the SDK's own (its encoder), so tracing still works; a unit test fails on such
an SDK so the fallback is never silent. Not carried over from the SDK's `export`: its 64 MiB request limit (a
batch is at most OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans of a few hundred bytes) and its opt-in self-metrics
(OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED). Imported only when tracing over HTTP is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from router.tracing.otlp_encode import Encoder
from router.tracing.trace import Span, readable


class LeanHttpSpanExporter(OTLPSpanExporter):
    TAKES_LEAN_SPANS = True  # the router's spans come as they were recorded (router/tracing/provider.py)

    def __init__(self, endpoint: str) -> None:
        self._encoder = Encoder()
        super().__init__(endpoint=endpoint)

    @property
    def lean(self) -> bool:
        """Whether this SDK has the export path the lean body goes through (else `export` is the SDK's own)."""
        return callable(getattr(getattr(self, "_client", None), "export", None))

    def export(self, spans: Sequence[ReadableSpan | Span]) -> SpanExportResult:
        if getattr(self, "_shutdown", False) or not self.lean:
            return super().export(readable(spans))
        client: Any = self._client
        ok = client.export(self._encoder.encode(spans)).success  # the client logs a failure and its reason
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE
