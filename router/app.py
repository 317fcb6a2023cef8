"""The HTTP surface: routes, lifespan, error → status mapping, disconnect watching. The only fastapi importer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router import auth, protocol
from router.admission import Admission
from router.answer import JsonAnswer, StreamAnswer
from router.config import Settings, parse_decode_url, parse_prefill_spec
from router.dispatch import Call
from router.domain import Endpoint, RequestInfo, Role, WorkerSpec
from router.errors import (
    BadRequest,
    ConfigError,
    NoHealthyWorker,
    Overloaded,
    RouterError,
    Unauthorized,
    UpstreamError,
)
from router.service import Service
from router.upstream import translate

logger = logging.getLogger("kvpush.app")
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """Everything is built here and in the lifespan; nothing lives at module level."""
    service = Service(settings, transport=transport, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="kvpush router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = service  # the drain switch, for the process around the app (cli.py)

    @app.exception_handler(RouterError)
    async def router_error(request: Request, error: RouterError) -> Response:
        service.metrics.errors.labels(error.kind).inc()
        return _error_response(error, request.headers.get(protocol.REQUEST_ID_HEADER, ""))

    _openai_routes(app, service)
    _operations_routes(app, service)
    _admin_routes(app, service)
    return app


def _openai_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(service, request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(service, request, Endpoint.CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        pool, client = service.pool, service.client
        for view in pool.candidates(Role.DECODE):
            url = f"{pool.get(view.id).spec.url}/v1/models"
            try:
                answer = await client.get(url, timeout=service.settings.timeouts.health)
            except httpx.HTTPError as exc:
                logger.warning("GET %s: %s", url, translate(exc, leg="decode", worker=view.id).message)
                continue
            if answer.is_success:
                return Response(answer.content, media_type="application/json")
        raise NoHealthyWorker("no healthy decode worker answered /v1/models")


def _operations_routes(app: FastAPI, service: Service) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        ok = service.ready()
        body = {
            "ready": ok,
            "draining": service.draining,
            "mode": str(service.settings.mode),
            "workers": service.pool.snapshot(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, content_type = service.metrics.render()
        return Response(content, media_type=content_type)

    @app.get("/debug/timings")
    async def debug_timings(request_id: str | None = None, pairing_id: str | None = None) -> dict[str, Any]:
        return {"requests": service.timings.query(request_id=request_id, pairing_id=pairing_id)}


def _admin_routes(app: FastAPI, service: Service) -> None:
    settings, pool = service.settings, service.pool

    def check(request: Request) -> None:
        auth.check_admin(request.headers.get("authorization"), settings.admin_key)

    @app.get("/admin/workers")
    async def admin_list(request: Request) -> dict[str, Any]:
        check(request)
        return {"workers": pool.snapshot()}

    @app.post("/admin/workers")
    async def admin_add(request: Request) -> Response:
        check(request)
        spec = _worker_from(await _json_object(request))
        if str(spec.role) in settings.discovery:
            raise BadRequest(f"{spec.role} workers come from discovery here; add them there, not by hand")
        added = pool.add(spec)
        await pool.probe_all(service.client, settings.timeouts.health)
        return JSONResponse({"added": added, "url": spec.url}, status_code=201 if added else 200)

    @app.post("/admin/workers/drain")
    async def admin_drain(request: Request) -> dict[str, Any]:
        check(request)
        url = _url_of(await _json_object(request))
        if not pool.drain(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"draining": url}

    @app.post("/admin/workers/remove")
    async def admin_remove(request: Request) -> dict[str, Any]:
        check(request)
        url = _url_of(await _json_object(request))
        if not pool.remove(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"removed": url}


async def _serve(service: Service, request: Request, endpoint: Endpoint) -> Response:
    """One OpenAI request: auth, admission, then validation and dispatch; a relayed stream keeps its slot."""
    request_id = request.headers.get(protocol.REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
    auth.check_client(request.headers.get("authorization"), service.settings.api_keys)
    try:
        await service.admission.acquire()
    except Overloaded as refused:
        service.metrics.requests.labels(str(endpoint), str(service.settings.mode), refused.kind).inc()
        return _error_response(refused, request_id)
    response: Response | None = None
    try:
        response = await _admitted(service, request, endpoint, request_id)
        return response
    finally:
        if not isinstance(response, RelayResponse):
            service.admission.release()  # a relayed stream holds its slot until it ends


async def _admitted(service: Service, request: Request, endpoint: Endpoint, request_id: str) -> Response:
    raw = await request.body()
    try:
        info, body = _parse(endpoint, raw)
    except BadRequest as bad:
        service.metrics.errors.labels(bad.kind).inc()
        service.metrics.requests.labels(str(endpoint), str(service.settings.mode), bad.kind).inc()
        return _error_response(bad, request_id)
    call = Call(body=body, info=info, record=service.dispatcher.new_record(request_id, info))
    try:
        answer = await _until_disconnect(request.receive, service.dispatcher.handle(call))
    except RouterError as failed:
        return _error_response(failed, request_id, call.record.pairing_id)
    except ClientGone:
        return Response(status_code=499)
    headers = {protocol.REQUEST_ID_HEADER: request_id, protocol.PAIRING_ID_HEADER: call.record.pairing_id or ""}
    if isinstance(answer, JsonAnswer):
        return Response(answer.content, status_code=answer.status, media_type="application/json", headers=headers)
    return RelayResponse(answer, headers, service.admission)


def _parse(endpoint: Endpoint, raw: bytes) -> tuple[RequestInfo, dict[str, Any]]:
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    return protocol.parse_request(endpoint, body), body


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _url_of(body: dict[str, Any]) -> str:
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required")
    return url.rstrip("/")


def _worker_from(body: dict[str, Any]) -> WorkerSpec:
    """An admin's new worker: {"role": "prefill"|"decode", "url": ..., optional prefill identity fields}."""
    role, url = body.get("role"), _url_of(body)
    options = {k: v for k, v in body.items() if k not in ("role", "url")}
    try:
        if role == "prefill":
            return parse_prefill_spec(",".join([url, *(f"{k}={v}" for k, v in options.items())]))
        if role == "decode" and not options:
            return parse_decode_url(url)
    except ConfigError as bad:
        raise BadRequest(str(bad)) from None
    raise BadRequest("'role' must be 'prefill' or 'decode' (decode workers take only a url)")


def _error_response(error: RouterError, request_id: str, pairing_id: str | None = None) -> Response:
    headers = {protocol.REQUEST_ID_HEADER: request_id} if request_id else {}
    if pairing_id:
        headers[protocol.PAIRING_ID_HEADER] = pairing_id
    if isinstance(error, Overloaded):
        headers["retry-after"] = str(error.retry_after)
    if isinstance(error, Unauthorized):
        headers["www-authenticate"] = "Bearer"
    if isinstance(error, UpstreamError) and error.http_status >= 500:
        logger.warning("request %s failed: %s", request_id, error.message)
    return Response(error.to_json(), status_code=error.http_status, media_type="application/json", headers=headers)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Runs `work` unless the client leaves first; then `work` is cancelled, which closes both upstream legs."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            raise ClientGone
        result = task.result()
        if watcher.done() and isinstance(result, StreamAnswer):
            await result.aclose()
            raise ClientGone
        return result
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class RelayResponse(StreamingResponse):
    """Relays a primed decode stream event by event; closes it (and so the upstream legs) however it ends."""

    def __init__(self, answer: StreamAnswer, headers: dict[str, str], admission: Admission) -> None:
        super().__init__(
            answer.events(),
            status_code=200,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self._answer = answer
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()
        finally:
            for task in (pump, watcher):
                task.cancel()
            await asyncio.wait({pump, watcher})
            try:
                await asyncio.shield(self._answer.aclose())
            finally:
                self._admission.release()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.body_iterator:
            chunk = event if isinstance(event, bytes) else str(event).encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
