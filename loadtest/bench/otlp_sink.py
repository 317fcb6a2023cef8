"""An OTLP/gRPC trace sink for the overhead suite: accepts every TraceService/Export and drops it (no decoding),
counting requests and bytes. It runs on the suite's own threads, so what it costs is not the router's CPU."""

from __future__ import annotations

import threading
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc  # type: ignore[import-untyped]

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


class OtlpSink:
    """`with OtlpSink() as sink:` routers export to `sink.endpoint` (gRPC, insecure, loopback)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        method = grpc.unary_unary_rpc_method_handler(self._export)  # raw bytes in and out: nothing decoded
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Export": method}),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _export(self, request: bytes, context: Any) -> bytes:
        with self._lock:
            self.requests += 1
            self.bytes += len(request)
        return b""  # an empty ExportTraceServiceResponse

    def __enter__(self) -> OtlpSink:
        self._server.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._server.stop(1.0).wait(5.0)
