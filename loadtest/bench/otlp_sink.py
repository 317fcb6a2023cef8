"""An OTLP trace sink for the overhead suite: accepts every TraceService/Export over gRPC and every POST of
/v1/traces over HTTP/protobuf and drops it (no decoding), counting requests and bytes.

The suite runs it in a process of its own (`SinkProcess`, `python -m loadtest.bench.otlp_sink`): not the router's
CPU, and not the load generator's either. In the suite's own process its gRPC server took the client's GIL at each
export (only while a traced router was measured: a different load for the traced fronts), and its poller threads
made forking the routers and simulators started after it fail now and then (a child killed by gRPC's fork handler
before its exec: "Epoll1Poller ... epoll_wait error: Bad file descriptor", the process gone with SIGABRT).
`OtlpSink` is the server itself, in the calling process (the tests use it directly).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc  # type: ignore[import-untyped]

STOP_SECONDS = 5.0  # the longest SinkProcess waits for the sink to report and exit
REPO = Path(__file__).resolve().parents[2]  # where `python -m loadtest.bench.otlp_sink` runs

_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


TRACES_PATH = "/v1/traces"
READ_SECONDS = 5.0  # the HTTP listener's deadline for a request's read and write


class OtlpSink:
    """`with OtlpSink() as sink:` routers export to `sink.endpoint` (gRPC, insecure, loopback) or to
    `sink.http_endpoint` (HTTP/protobuf, loopback)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        method = grpc.unary_unary_rpc_method_handler(self._export)  # raw bytes in and out: nothing decoded
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Export": method}),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self._took))
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-sink-http", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}{TRACES_PATH}"

    def _export(self, request: bytes, context: Any) -> bytes:
        self._took(len(request))
        return b""  # an empty ExportTraceServiceResponse

    def _took(self, size: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += size

    def __enter__(self) -> OtlpSink:
        self._server.start()
        self._http_thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._server.stop(1.0).wait(5.0)


def _handler(took: Callable[[int], None]) -> type[BaseHTTPRequestHandler]:
    class Export(BaseHTTPRequestHandler):
        """POST /v1/traces: reads the body, counts it, answers an empty ExportTraceServiceResponse."""

        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects
        timeout = READ_SECONDS

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(size)
            if self.path != TRACES_PATH:
                self._answer(404)
                return
            took(size)
            self._answer(200)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return  # one line per export would flood the suite's log

    return Export


class SinkProcess:
    """`with SinkProcess() as sink:` an OtlpSink in a child process; `sink.endpoint` while it runs, and once the
    block ends `sink.requests`, `sink.bytes` (what it took) and `sink.pid`."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.port = 0
        self.http_port = 0
        self.pid = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}{TRACES_PATH}"

    def __enter__(self) -> SinkProcess:
        cmd = [sys.executable, "-m", "loadtest.bench.otlp_sink"]
        self._proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # "port GRPC HTTP" once it listens
        if not line.startswith("port "):
            self._proc.kill()
            self._proc.wait(STOP_SECONDS)
            raise RuntimeError(f"otlp sink did not start: {line!r}")
        self.port, self.http_port = (int(x) for x in line.split()[1:3])
        self.pid = self._proc.pid
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        proc = self._proc
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=STOP_SECONDS)
        for line in out.splitlines():  # "took REQUESTS BYTES" on its way out
            if line.startswith("took "):
                self.requests, self.bytes = (int(x) for x in line.split()[1:3])


def main(argv: list[str] | None = None) -> None:
    """Serves until SIGTERM, then prints what it took: `port GRPC HTTP` first, `took REQUESTS BYTES` last."""
    argparse.ArgumentParser(description="OTLP/gRPC and OTLP/HTTP trace sink (drops what it gets)").parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with OtlpSink() as sink:
        print(f"port {sink.port} {sink.http_port}", flush=True)
        while not stop.wait(1.0):
            pass
    print(f"took {sink.requests} {sink.bytes}", flush=True)


if __name__ == "__main__":
    main()
