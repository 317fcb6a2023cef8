"""Test support for our connector on real vLLM: both legs sent by hand (as the router would), a failing stand-in
prefill and a streamed answer read to its end. Engines start through `stack.family` (tests/integration/
vllm_support.py `started()` runs a family and knows when its engines are idle)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tests.integration.vllm_support import Engines

__all__ = [
    "CONNECTOR",
    "CONNECTOR_EXTRA",
    "KV_TIMEOUT_S",
    "MODULE",
    "FailingPrefill",
    "StreamEnd",
    "decode_params",
    "post",
    "prefill_body",
    "push",
    "read_stream",
]

CONNECTOR = "KvpushConnector"
MODULE = "connector.plugin"
# D's hold deadline for one registration (kv_connector_extra_config): a request failed by link loss keeps its
# blocks (quarantine, guarantee G2) this long. Shorter than the default 120 s so a test can watch it end (the
# kill test in test_pd_e2e waits for it), long enough for the slowest prefill a registration waits for here (a
# 600-token prompt on the chunked p1, 2 tokens a step: under 10 s in CI).
KV_TIMEOUT_S = 25.0
CONNECTOR_EXTRA = {"kv_timeout_s": KV_TIMEOUT_S}


def decode_params(engines: Engines, prefill: int, request_id: str, transfer_id: str) -> dict[str, Any]:
    spec = engines.prefills[prefill].engine_spec
    return {
        "do_remote_prefill": True,
        "remote_engine_id": spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": spec.side_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return dict(
        body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id}
    )


def post(url: str, body: dict[str, Any], request_id: str, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=timeout)


def push(engines: Engines, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """Both legs straight to p0 and the decode at once, same X-Request-Id and transfer id, as the router does."""
    rid, tid = f"kvp-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(2) as pool:
        d_body = dict(body, kv_transfer_params=decode_params(engines, 0, rid, tid))
        d_leg = pool.submit(post, engines.decode.url, d_body, rid)
        p_leg = pool.submit(post, engines.prefills[0].url, prefill_body(body, tid), rid)
        return p_leg.result(), d_leg.result()


@dataclass
class StreamEnd:
    """How a streamed decode answer ended."""

    status: int
    events: list[dict[str, Any]]
    seconds: float  # from `started()` to the end of the answer
    other: list[str] = field(default_factory=list)  # non-event lines (an error body)
    error: str | None = None  # transport error, if the connection broke instead

    @property
    def text(self) -> str:
        return "".join(c.get("text") or "" for e in self.events for c in e.get("choices") or [])

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices") or [] if c.get("finish_reason")]


class FailingPrefill:
    """A stand-in prefill worker: healthy, but every completion gets HTTP 503 after `delay` s.

    Given a real prefill's NIXL identity in the router's --prefill spec, a decode leg paired with it really
    registers with that prefill's connector; only the prefill leg fails, so the router retries with fresh ids.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
                self._reply(200, body if self.path == "/v1/models" else b"")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.calls += 1
                time.sleep(outer.delay)
                self._reply(503, json.dumps({"error": {"message": "stand-in prefill refuses"}}).encode())

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="failing-prefill", daemon=True)

    def __enter__(self) -> FailingPrefill:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def read_stream(
    client: httpx.Client, url: str, body: dict[str, Any], request_id: str, started: Callable[[], float]
) -> StreamEnd:
    """POST a streamed request and read it to its end; `started()` is when the clock for `seconds` began."""
    events: list[dict[str, Any]] = []
    other: list[str] = []
    try:
        with client.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                elif line.strip() and line != "data: [DONE]":
                    other.append(line)
            return StreamEnd(response.status_code, events, time.monotonic() - started(), other)
    except httpx.TransportError as exc:
        return StreamEnd(0, events, time.monotonic() - started(), other, error=repr(exc))
