"""Scriptable prefill/decode workers behind httpx.MockTransport (our transport seam), for dispatcher tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

Handler = Callable[[httpx.Request, dict[str, Any]], Awaitable[httpx.Response]]


@dataclass
class Seen:
    """One request a fake worker received."""

    worker: str
    path: str
    headers: httpx.Headers
    body: dict[str, Any]


@dataclass
class FakeWorkers:
    """Routes by host: each host has a handler; every request is recorded in arrival order."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    down: set[str] = field(default_factory=set)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        body = json.loads(request.content) if request.content else {}
        self.seen.append(Seen(host, request.url.path, request.headers, body))
        return await self.handlers[host](request, body)

    def legs(self, host: str) -> list[Seen]:
        return [s for s in self.seen if s.worker == host]


def prefill_ok(
    engine_id: str = "p0", mode: str = "push", gate: asyncio.Event | None = None, done: asyncio.Event | None = None
) -> Handler:
    """Answers like a vLLM prefill; waits for `gate` first and sets `done` (the KV is "written") after."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if gate is not None:
            await gate.wait()
        if done is not None:
            done.set()
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_host": "127.0.0.9",
            "remote_port": 5600,
            "tp_size": 1,
            "pp_size": 1,
            "remote_block_ids": [[1, 2]],
            "remote_request_id": "cmpl-x",
            "transfer_mode": mode,
        }
        return httpx.Response(200, json={"id": "cmpl-p", "choices": [{"text": "a"}], "kv_transfer_params": params})

    return handle


def status(code: int, message: str = "boom") -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(code, json={"error": {"message": message, "type": "x", "code": code}})

    return handle


def hang(closed: asyncio.Event | None = None) -> Handler:
    """Never answers; sets `closed` when the router gives up on the request (cancels it)."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        try:
            await asyncio.Event().wait()
        finally:
            if closed is not None:
                closed.set()
        raise AssertionError("unreachable")

    return handle


def decode_ok(
    tokens: int = 3,
    on_request: Callable[[], None] | None = None,
    closed: asyncio.Event | None = None,
    hold: asyncio.Event | None = None,
    kv: asyncio.Event | None = None,
) -> Handler:
    """Streams `tokens` SSE events (or one JSON answer) once `kv` is set; `hold` pauses after the first event."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if on_request is not None:
            on_request()
        if kv is not None:
            await kv.wait()
        if not body.get("stream"):
            return httpx.Response(200, json={"id": "cmpl-d", "choices": [{"text": "x" * tokens}]})

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(tokens):
                    yield f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode()
                    if hold is not None and i == 0:
                        await hold.wait()
                yield b"data: [DONE]\n\n"
            finally:
                if closed is not None:
                    closed.set()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle


def decode_error_event(message: str = "KV load failed") -> Handler:
    """Answers 200 and then, as vLLM does when a request fails inside the engine, an error event."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        event = json.dumps({"error": {"message": message, "type": "InternalServerError", "code": 500}})

        async def events() -> AsyncIterator[bytes]:
            yield f"data: {event}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle
