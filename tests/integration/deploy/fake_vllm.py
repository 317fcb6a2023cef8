"""A tiny stand-in for one vLLM worker of a P/D pair, enough for the router to serve through it (stdlib only).

    python fake_vllm.py --role prefill|decode --port N [--fail-first K]

Prefill answers with `kv_transfer_params` (its NIXL identity); decode answers JSON or an SSE stream. Both
serve /health, /v1/models and a small vLLM-style /metrics. `--fail-first K` answers the first K completion
requests with 500, so the router's retry and error paths run too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "tiny"


class Worker(BaseHTTPRequestHandler):
    role = "decode"
    engine_id = "fake"
    fail_first = 0
    _count = itertools.count()
    _lock = threading.Lock()
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the router's log is what matters
        return

    def _json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/metrics":
            text = "".join(
                f'# TYPE {name} gauge\n{name}{{engine="0",model_name="{MODEL}"}} 0.0\n'
                for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            )
            body = text.encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        with self._lock:
            n = next(self._count)
        if n < self.fail_first:
            self._json(500, {"error": {"message": "fake failure", "type": "InternalServerError"}})
            return
        chat = self.path == "/v1/chat/completions"
        if self.role == "prefill":
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "pp_size": 1,
                "remote_request_id": self.headers.get("x-request-id", ""),
            }
            answer = self._answer(chat, "x", 1)
            answer["kv_transfer_params"] = params
            self._json(200, answer)
            return
        tokens = int(body.get("max_tokens") or 4)
        if not body.get("stream"):
            self._json(200, self._answer(chat, "x" * tokens, tokens))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(tokens):
            piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
            event = {
                "id": "fake",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, **piece, "finish_reason": "length" if i == tokens - 1 else None}],
            }
            self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            time.sleep(0.005)
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    @staticmethod
    def _answer(chat: bool, text: str, tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {
            "id": "fake",
            "object": "chat.completion" if chat else "text_completion",
            "model": MODEL,
            "choices": [choice],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-id", default="fake-p0")
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args()
    Worker.role, Worker.engine_id, Worker.fail_first = args.role, args.engine_id, args.fail_first
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Worker)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
