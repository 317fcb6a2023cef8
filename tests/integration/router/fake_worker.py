"""A slow stand-in vLLM worker for router tests that need long streams or many workers (not for KV behaviour).

    python -m tests.integration.router.fake_worker --port N [--engine-id ID] [--tokens 20] [--delay 0.1]

Answers /health, /v1/models, /metrics, and both completion endpoints: a prefill leg (kv_transfer_params with
do_remote_decode) gets push-mode params at once; any other request streams `tokens` events `delay` s apart
(or one JSON answer after tokens × delay). Exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def make_app(engine_id: str, tokens: int, delay: float) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    running = 0

    async def reply(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal running
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            return await reply(send, 200, b"")
        if path == "/v1/models":
            return await reply(send, 200, json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode())
        if path == "/metrics":
            text = f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} 0\n'
            return await reply(send, 200, text.encode(), b"text/plain")
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw or b"{}")
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            kv = {
                "do_remote_prefill": True,
                "remote_engine_id": engine_id,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "pp_size": 1,
                "transfer_mode": "push",
            }
            return await reply(send, 200, json.dumps({"choices": [{"text": "a"}], "kv_transfer_params": kv}).encode())
        running += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(tokens * delay)
                return await reply(send, 200, json.dumps({"choices": [{"text": "x" * tokens}]}).encode())
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i in range(tokens):
                event = json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]})
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
                await asyncio.sleep(delay)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            running -= 1

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--engine-id", default="fake-p")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--delay", type=float, default=0.1)
    a = p.parse_args()
    uvicorn.run(make_app(a.engine_id, a.tokens, a.delay), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
