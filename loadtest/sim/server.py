"""The simulator's HTTP surface: a raw ASGI app speaking vLLM's OpenAI API with kv_transfer_params.

Routes: POST /v1/completions, /v1/chat/completions; GET /health, /v1/models, /metrics; POST /tokenize; and the
simulated KV side channel on the same port: POST /kv/push (D registers, answered when P's WRITE is done) and
POST /kv/read (D's READ). One EngineLoop steps the EngineModel; each request waits on its own token queue.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from loadtest.prompts import word_ids
from loadtest.sim import costs, wire
from loadtest.sim.engine import (
    ChunkDone,
    EngineModel,
    Event,
    LegKind,
    PrefillDone,
    Req,
    StartPull,
    StartPush,
    StepEnd,
    Token,
)
from loadtest.sim.handoff import HandoffDesk, HandoffError
from loadtest.sim.loop import EngineLoop
from loadtest.sim.profile import Profile, load
from loadtest.sim.writes import WriteAt

log = logging.getLogger("loadtest.sim")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Item = tuple[str, bool, str]  # ("tok", final, "") | ("err", True, message)
SIDE_TIMEOUT_S = 600.0
LEG_LOG = 20000
PREFILL_WAIT_S = 300.0


class SimServer:
    def __init__(
        self,
        role: str,
        profile: Profile,
        engine_id: str,
        host: str,
        port: int,
        model: str,
        kv_mode: str = "both",
        clock: Callable[[], float] = time.monotonic,
        write_at: WriteAt = WriteAt.COMPLETING_STEP,
    ) -> None:
        self.role, self.profile, self.engine_id, self.host, self.port, self.model = (
            role,
            profile,
            engine_id,
            host,
            port,
            model,
        )
        self.kv_mode = kv_mode
        self.engine = EngineModel(profile, chunk_events=role != "decode")
        self.loop = EngineLoop(self.engine, asyncio.sleep, self._on_events)
        self.desk = HandoffDesk(profile, self._release, clock, asyncio.sleep, write_at=write_at)
        self.streams: dict[Req, asyncio.Queue[Item]] = {}
        self.remote: dict[Req, dict[str, Any]] = {}
        self.keys: dict[Req, str] = {}
        self.by_source: Counter[str] = Counter()
        self.success = 0
        self.client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # (handoff key, leg kind, CLOCK_MONOTONIC at arrival): one machine-wide clock, so a P's and a D's
        # entries can be joined to tell a concurrent front door (D's leg ~at once) from a sequential one
        self.legs: deque[tuple[str, str, float]] = deque(maxlen=LEG_LOG)

    # engine events ----------------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, req: Req) -> None:
        self.engine.release(req)
        self.loop.poke()

    def _on_events(self, events: Sequence[Event]) -> None:
        for ev in events:
            if isinstance(ev, Token):
                q = self.streams.get(ev.req)
                if q is not None:
                    q.put_nowait(("tok", ev.final, ""))
            elif isinstance(ev, ChunkDone):
                if (key := self.keys.get(ev.req)) is not None:
                    self.desk.on_chunk(key, ev.computed)
            elif isinstance(ev, StepEnd):
                if self.desk.on_step_end(ev.index):
                    self.engine.request_step()  # a next-step WRITE needs one more P step
            elif isinstance(ev, PrefillDone):
                self.desk.on_prefilled(self.keys.pop(ev.req))
            elif isinstance(ev, StartPull | StartPush) and not self.profile.rendezvous:
                self.remote.pop(ev.req, None)
                self.engine.kv_landed(ev.req)
                self.loop.poke()
            elif isinstance(ev, StartPull | StartPush):
                self._spawn(self._fetch_kv(ev.req, pull=isinstance(ev, StartPull)))

    async def _fetch_kv(self, req: Req, pull: bool) -> None:
        """D side: READ from P (pull) or register and wait for P's WRITE (push); then the KV has landed."""
        kv = self.remote.pop(req, {})
        url = f"http://{kv.get('remote_host', '127.0.0.1')}:{kv.get('remote_port')}/kv/{'read' if pull else 'push'}"
        body = {
            "key": str(kv.get("remote_request_id") if pull else wire.handoff_key(kv, req.rid)),
            "peer": self.engine_id,
        }
        assert self.client is not None
        try:
            resp = await self.client.post(url, json=body, timeout=SIDE_TIMEOUT_S)
            ok, why = resp.status_code == 200, f"KV {'read' if pull else 'push'} failed: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            ok, why = False, f"KV side channel: {type(exc).__name__}: {exc}"
        if ok and not pull:
            await asyncio.sleep(self.profile.notify_s)
        if ok:
            self.engine.kv_landed(req)
            self.loop.poke()
            return
        log.warning("request %s: %s", req.rid, why)
        self.engine.abort(req)
        q = self.streams.get(req)
        if q is not None:
            q.put_nowait(("err", True, why))

    # ASGI -------------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        body = await _read_body(receive) if method == "POST" else b""
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        try:
            await self._route(method, path, body, rid, receive, send)
        except (ValueError, KeyError, TypeError) as exc:
            await send_json(send, 400, {"error": {"message": f"bad request: {exc}"}}, rid)

    async def _route(self, method: str, path: str, body: bytes, rid: str, receive: Receive, send: Send) -> None:
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(json.loads(body), path.endswith("chat/completions"), rid, receive, send)
        elif method == "POST" and path in ("/kv/push", "/kv/read"):
            await self._side(json.loads(body), path == "/kv/read", rid, send)
        elif method == "GET" and path == "/health":
            await send_json(send, 200, {}, rid)
        elif method == "GET" and path == "/v1/models":
            await send_json(
                send,
                200,
                {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "kvpush-sim"}]},
                rid,
            )
        elif method == "GET" and path == "/debug/legs":
            await send_json(send, 200, {"legs": [list(x) for x in self.legs]}, rid)
        elif method == "GET" and path == "/metrics":
            await send_text(send, 200, self._metrics(), rid)
        elif method == "POST" and path == "/tokenize":
            ids = word_ids(str(json.loads(body).get("prompt", "")))
            await send_json(send, 200, {"count": len(ids), "tokens": ids, "max_model_len": 1 << 20}, rid)
        else:
            await send_json(send, 404, {"error": {"message": f"no route {method} {path}"}}, rid)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        runner: asyncio.Task[None] | None = None
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
                self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(SIDE_TIMEOUT_S, connect=10.0))
                runner = asyncio.ensure_future(self.loop.run())
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if runner is not None:
                    runner.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await runner
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _metrics(self) -> str:
        e = self.engine
        usage = e.used_tokens / e.profile.kv_capacity_tokens if e.profile.kv_capacity_tokens else 0.0
        loop = {
            "steps_total": self.loop.steps,
            "modeled_seconds_total": self.loop.busy_s,
            "lag_seconds_total": self.loop.lag_s,
        }
        return wire.metrics_text(self.model, e.num_running, len(e.waiting), usage, self.by_source, self.success, loop)

    # generation ------------------------------------------------------------------------------------------
    async def _generate(self, body: dict[str, Any], chat: bool, rid: str, receive: Receive, send: Send) -> None:
        inc = wire.parse(body, chat)
        self.legs.append((wire.handoff_key(inc.kv, rid), inc.kind.value, time.monotonic()))
        await asyncio.sleep(costs.api_time(self.profile, inc.prompt_tokens))
        req = Req(rid=rid, kind=inc.kind, prompt=inc.prompt_tokens, max_tokens=inc.max_tokens)
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.streams[req] = queue
        key = wire.handoff_key(inc.kv, rid)
        if inc.kind is LegKind.PREFILL:
            self.keys[req] = key
            self.desk.on_leg(key, req)
        elif inc.kind in (LegKind.PULL, LegKind.PUSH):
            self.remote[req] = dict(inc.kv)
        self.engine.add(req)
        self.loop.poke()
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            work = asyncio.ensure_future(self._respond(req, inc, queue, key, send))
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            else:
                work.result()
        finally:
            watcher.cancel()
            self.streams.pop(req, None)
            self.remote.pop(req, None)
            if req.state.value not in ("done", "held"):
                self.engine.abort(req)
                if inc.kind is LegKind.PREFILL:
                    self.keys.pop(req, None)
                    self.desk.on_leg_failed(key)

    async def _respond(self, req: Req, inc: wire.Incoming, queue: asyncio.Queue[Item], key: str, send: Send) -> None:
        if inc.stream:
            await self._stream(req, inc, queue, send)
            return
        n = 0
        while True:
            kind, final, msg = await queue.get()
            if kind == "err":
                await send_json(send, 500, {"error": {"message": msg}}, req.rid)
                return
            n += 1
            if final:
                break
        self._count(req)
        kv = None
        if inc.kind is LegKind.PREFILL:
            kv = wire.prefill_kv_params(
                self.engine_id,
                self.host,
                self.port,
                key,
                req.prompt,
                costs.blocks(self.profile, req.prompt),
                self.kv_mode,
            )
        await send_json(send, 200, wire.full_response(req.rid, self.model, inc.chat, req.prompt, n, kv), req.rid)

    async def _stream(self, req: Req, inc: wire.Incoming, queue: asyncio.Queue[Item], send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _headers(b"text/event-stream", req.rid)})
        n = 0
        while True:
            kind, final, msg = await queue.get()
            if kind == "err":
                err = {"error": {"message": msg, "code": 500}}
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(err).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
                break
            n += 1
            body = wire.chunk(req.rid, self.model, inc.chat, first=n == 1, final=final)
            if final:
                self._count(req)
                if inc.include_usage:
                    body += wire.usage_chunk(req.rid, self.model, inc.chat, req.prompt, n)
                body += wire.DONE
            await send({"type": "http.response.body", "body": body, "more_body": not final})
            if final:
                return
        await send({"type": "http.response.body", "body": wire.DONE, "more_body": False})

    def _count(self, req: Req) -> None:
        self.success += 1
        src = "external_kv_transfer" if req.kind in (LegKind.PULL, LegKind.PUSH) else "local_compute"
        self.by_source[src] += req.prompt

    async def _side(self, body: dict[str, Any], read: bool, rid: str, send: Send) -> None:
        key, peer = str(body["key"]), str(body.get("peer", ""))
        try:
            if read:
                took = await self.desk.read(key, peer)
            else:
                took = await self.desk.push(key, peer, PREFILL_WAIT_S)
        except HandoffError as exc:
            await send_json(send, 404, {"error": {"message": str(exc)}}, rid)
            return
        await send_json(send, 200, {"key": key, "seconds": took}, rid)


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _headers(ctype: bytes, rid: str, length: int | None = None) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", ctype), (b"x-request-id", rid.encode())]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out


async def send_json(send: Send, status: int, obj: Any, rid: str) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": _headers(b"application/json", rid, len(data))}
    )
    await send({"type": "http.response.body", "body": data})


async def send_text(send: Send, status: int, text: str, rid: str) -> None:
    data = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": _headers(b"text/plain; version=0.0.4", rid, len(data)),
        }
    )
    await send({"type": "http.response.body", "body": data})


def serve(
    role: str,
    host: str,
    port: int,
    profile: str,
    engine_id: str,
    model: str,
    kv_mode: str,
    write_at: str = WriteAt.COMPLETING_STEP.value,
) -> int:
    """Run one simulated engine until interrupted (uvicorn, httptools, uvloop when available)."""
    import uvicorn

    app = SimServer(role, load(profile), engine_id, host, port, model, kv_mode, write_at=WriteAt(write_at))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=75,
        backlog=4096,
    )
    return 0
