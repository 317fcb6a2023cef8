"""An OTLP trace receiver for tests: a gRPC `TraceService/Export` server and an HTTP/protobuf `POST /v1/traces`
server on loopback, decoding each ExportTraceServiceRequest with opentelemetry-proto into plain `ReceivedSpan`s.

    with OtlpReceiver() as receiver:
        ... point exporters at receiver.grpc_endpoint or receiver.http_endpoint ...
        spans = receiver.wait_for(lambda got: any(s.name == "llm_request" for s in got), "vLLM's span")

Both servers run on their own threads and stop on exit; nothing leaves loopback.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

_KINDS = {
    Span.SPAN_KIND_UNSPECIFIED: "unspecified",
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}
_STATUS = {Status.STATUS_CODE_UNSET: "unset", Status.STATUS_CODE_OK: "ok", Status.STATUS_CODE_ERROR: "error"}
MAX_BODY = 64 * 2**20


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP exporter sent it. Ids are lower-case hex; parent_span_id is None for a root."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: str
    start_ns: int
    end_ns: int
    events: tuple[str, ...] = ()
    via: str = ""  # "grpc" or "http"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def service(self) -> str | None:
        value = self.resource.get("service.name")
        return value if isinstance(value, str) else None


def value_of(value: AnyValue) -> Any:
    """An OTLP AnyValue as a Python value."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which)


def attributes_of(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        out[pair.key] = value_of(pair.value)
    return out


def decode(request: trace_service_pb2.ExportTraceServiceRequest, via: str) -> list[ReceivedSpan]:
    """Every span of one export request."""
    out = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        kind=_KINDS.get(span.kind, str(span.kind)),
                        attributes=attributes_of(span.attributes),
                        resource=resource,
                        status=_STATUS.get(span.status.code, str(span.status.code)),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        events=tuple(e.name for e in span.events),
                        via=via,
                        extra={"scope": scope_spans.scope.name},
                    )
                )
    return out


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(  # the gRPC method's name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._sink(decode(request, "grpc"))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """gRPC and HTTP/protobuf OTLP trace receivers on 127.0.0.1, ephemeral ports; spans collected in order."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _Servicer(self._add), self._grpc
        )
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self._add))
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], what: str, timeout: float = 60.0
    ) -> list[ReceivedSpan]:
        """The spans received so far once `predicate` holds on them; fails the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    pytest.fail(f"{what}: not received within {timeout:g} s (got {len(self._spans)}: {names})")
                self._changed.wait(left)
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=1.0).wait(5.0)
        self._http.shutdown()
        self._http.server_close()
        self._http_thread.join(5.0)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _handler(sink: Callable[[list[ReceivedSpan]], None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            length = int(self.headers.get("content-length") or 0)
            if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                self.send_error(404 if self.path != "/v1/traces" else 400)
                return
            body = self.rfile.read(length)
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            sink(decode(request, "http"))
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    return Handler
