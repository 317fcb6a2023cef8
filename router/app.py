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
from router.discovery.build import build_source
from router.discovery.settings import parse_discovery
from router.dispatch import Call, Dispatcher
from router.domain import Endpoint, Role, WorkerSpec
from router.errors import (
    BadRequest,
    ConfigError,
    NoHealthyWorker,
    Overloaded,
    RouterError,
    Unauthorized,
    UpstreamError,
)
from router.health import HealthPolicy
from router.metrics import Metrics
from router.pool import Pool
from router.scrape import Scraper
from router.timings import TimingLog
from router.upstream import make_client, translate

logger = logging.getLogger("kvpush.app")
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class Runtime:
    """What the process around the app needs to reach: the drain switch (SIGTERM handling in cli.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.draining = False

    def begin_drain(self) -> None:
        if not self.draining:
            logger.info("draining: /ready answers 503 from now on")
        self.draining = True
        self._metrics.draining.set(1)


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """Everything is built here and in the lifespan; nothing lives at module level."""
    metrics = Metrics()
    health_policy = HealthPolicy(settings.eject_after, settings.eject_backoff, settings.eject_backoff_max)
    pool = Pool((*settings.prefill, *settings.decode), metrics, health_policy, clock)
    timings = TimingLog(settings.timings_capacity)
    client = make_client(settings, transport)
    dispatcher = Dispatcher(settings, pool, client, metrics, timings, clock)
    admission = Admission(settings.max_in_flight, settings.admission_queue, settings.admission_wait, metrics)
    runtime = Runtime(metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.probe_all(client, settings.timeouts.health)
        loops = {asyncio.create_task(pool.run_health(client, settings.health_interval, settings.timeouts.health))}
        for source_config in parse_discovery(settings.discovery):
            source = build_source(source_config, on_error=lambda role, _: metrics.discovery_errors.labels(
                str(role)).inc())
            loops.add(asyncio.create_task(source.run(pool)))
        if settings.scrape_interval > 0:
            scraper = Scraper(client, pool.all_members, pool, interval=settings.scrape_interval,
                              timeout=settings.timeouts.health,
                              on_error=lambda spec, _: metrics.scrape_errors.labels(str(spec.role)).inc())
            loops.add(asyncio.create_task(scraper.run()))
        try:
            yield
        finally:
            for task in loops:
                task.cancel()
            await asyncio.wait(loops)
            await dispatcher.aclose()
            await client.aclose()

    app = FastAPI(title="kvpush router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = runtime

    @app.exception_handler(RouterError)
    async def router_error(request: Request, error: RouterError) -> Response:
        metrics.errors.labels(error.kind).inc()
        return _error_response(error, request.headers.get(protocol.REQUEST_ID_HEADER, ""))

    async def serve(request: Request, endpoint: Endpoint) -> Response:
        request_id = request.headers.get(protocol.REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        auth.check_client(request.headers.get("authorization"), settings.api_keys)
        try:
            await admission.acquire()
        except Overloaded as refused:
            metrics.requests.labels(str(endpoint), str(settings.mode), refused.kind).inc()
            return _error_response(refused, request_id)
        response: Response | None = None
        try:
            response = await admitted(request, endpoint, request_id)
            return response
        finally:
            if not isinstance(response, RelayResponse):
                admission.release()  # a relayed stream holds its slot until it ends

    async def admitted(request: Request, endpoint: Endpoint, request_id: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
            error: BadRequest | None = BadRequest("the request body is not valid JSON")
        else:
            error = None
        try:
            if error is not None:
                raise error
            info = protocol.parse_request(endpoint, body)
        except BadRequest as bad:
            metrics.errors.labels(bad.kind).inc()
            metrics.requests.labels(str(endpoint), str(settings.mode), bad.kind).inc()
            return _error_response(bad, request_id)
        call = Call(body=body, info=info, record=dispatcher.new_record(request_id, info))
        try:
            answer = await _until_disconnect(request.receive, dispatcher.handle(call))
        except RouterError as failed:
            return _error_response(failed, request_id, call.record.pairing_id)
        except ClientGone:
            return Response(status_code=499)
        headers = {protocol.REQUEST_ID_HEADER: request_id, protocol.PAIRING_ID_HEADER: call.record.pairing_id or ""}
        if isinstance(answer, JsonAnswer):
            return Response(answer.content, status_code=answer.status, media_type="application/json", headers=headers)
        return RelayResponse(answer, headers, admission)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, Endpoint.CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        for view in pool.candidates(Role.DECODE):
            url = f"{pool.get(view.id).spec.url}/v1/models"
            try:
                answer = await client.get(url, timeout=settings.timeouts.health)
            except httpx.HTTPError as exc:
                logger.warning("GET %s: %s", url, translate(exc, leg="decode", worker=view.id).message)
                continue
            if answer.is_success:
                return Response(answer.content, media_type="application/json")
        raise NoHealthyWorker("no healthy decode worker answered /v1/models")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        serving = pool.ready() or (settings.fallback == "decode-only" and bool(pool.candidates(Role.DECODE)))
        ok = serving and not runtime.draining
        body = {"ready": ok, "draining": runtime.draining, "mode": str(settings.mode), "workers": pool.snapshot()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/admin/workers")
    async def admin_list(request: Request) -> dict[str, Any]:
        auth.check_admin(request.headers.get("authorization"), settings.admin_key)
        return {"workers": pool.snapshot()}

    @app.post("/admin/workers")
    async def admin_add(request: Request) -> Response:
        auth.check_admin(request.headers.get("authorization"), settings.admin_key)
        spec = _worker_from(await _json_object(request))
        if str(spec.role) in settings.discovery:
            raise BadRequest(f"{spec.role} workers come from discovery here; add them there, not by hand")
        added = pool.add(spec)
        await pool.probe_all(client, settings.timeouts.health)
        return JSONResponse({"added": added, "url": spec.url}, status_code=201 if added else 200)

    @app.post("/admin/workers/drain")
    async def admin_drain(request: Request) -> dict[str, Any]:
        auth.check_admin(request.headers.get("authorization"), settings.admin_key)
        url = _url_of(await _json_object(request))
        if not pool.drain(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"draining": url}

    @app.post("/admin/workers/remove")
    async def admin_remove(request: Request) -> dict[str, Any]:
        auth.check_admin(request.headers.get("authorization"), settings.admin_key)
        url = _url_of(await _json_object(request))
        if not pool.remove(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"removed": url}

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    @app.get("/debug/timings")
    async def debug_timings(request_id: str | None = None, pairing_id: str | None = None) -> dict[str, Any]:
        return {"requests": timings.query(request_id=request_id, pairing_id=pairing_id)}

    return app


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
        super().__init__(answer.events(), status_code=200, media_type="text/event-stream",
                         headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
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
