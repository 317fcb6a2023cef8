"""The HTTP surface: the two hot routes as a plain ASGI handler, FastAPI for the rest, errors → OpenAI bodies.
The only fastapi/starlette importer.

The hot path, in the order it runs (`HotPath.serve`): header limits (431), key (401), request id, the body under
its deadline and size limit (408/413; no admission slot is held while a client uploads), strict JSON (400),
validation (400), admission (429), then the dispatch and the relay under one disconnect watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from router import auth, fanout, heap, passthrough, protocol, responses
from router.answer import JsonAnswer, StreamAnswer
from router.apis import api_of
from router.config import Settings
from router.deciders.conversation import SESSION_HEADER
from router.dispatch import ClientRequest
from router.domain import Endpoint, RequestInfo, Role
from router.errors import (
    BadRequest,
    HeadersTooLarge,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    RouterError,
    Unauthorized,
    UpstreamError,
)
from router.service import Service
from router.tracing import context as trace_context
from router.tracing import semconv
from router.tracing.provider import Tracing
from router.tracing.trace import RequestTrace

logger = logging.getLogger("kvpush.app")
_HOT = {endpoint.path: endpoint for endpoint in Endpoint}
_JSON = (b"content-type", b"application/json")
_STREAM = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_REQUEST_ID = protocol.REQUEST_ID_HEADER.encode()
_PAIRING_ID = protocol.PAIRING_ID_HEADER.encode()


class ClientGone(Exception):
    """The client closed its connection before its request was in."""


def create_app(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """Everything is built here and in the lifespan; nothing lives at module level. `freeze_heap`: once the service
    has started, start-up's objects are kept out of the garbage collector's walks (router/heap.py; the served
    router does it, tests need not)."""
    service = Service(settings, transport=transport, clock=clock, tracing=tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if freeze_heap:
            heap.settle()
        try:
            yield
        finally:
            await service.stop()

    app = RouterApp(HotPath(service), lifespan=lifespan)
    app.state.service = service  # the drain switch, for the process around the app (cli.py)
    _error_handlers(app, service)
    _openai_routes(app, service)
    _operations_routes(app, service)
    _admin_routes(app, service)
    return app


class RouterApp(FastAPI):
    """FastAPI, except that POSTs to the hot routes (router/domain.py `Endpoint`) go straight to the hot path."""

    def __init__(self, hot: HotPath, **kwargs: Any) -> None:
        super().__init__(title="kvpush router", docs_url=None, redoc_url=None, openapi_url=None, **kwargs)
        self._hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = _HOT.get(scope["path"])
            if endpoint is not None and scope["method"] == "POST":
                await self._hot.serve(scope, receive, send, endpoint)
                return
            too_big = self._hot.header_limits(scope["headers"])
            if too_big is not None:
                await _send_error(send, too_big, protocol.client_request_id(None, 0))
                return
        await super().__call__(scope, receive, send)


class HotPath:
    """POST /v1/completions, /v1/chat/completions, /v1/messages and /v1/responses, without a framework. Every
    error is in the endpoint's own shape (router/apis.py: Anthropic's for Messages)."""

    def __init__(self, service: Service) -> None:
        self._service = service
        s = service.settings
        self._limits, self._timeouts, self._keys, self._mode = s.limits, s.timeouts, s.api_keys, str(s.mode)
        self._metrics = service.metrics
        self._tracing = service.tracing

    def header_limits(self, headers: list[tuple[bytes, bytes]]) -> HeadersTooLarge | None:
        limits = self._limits
        if len(headers) > limits.max_headers:
            return HeadersTooLarge(f"more than {limits.max_headers} request headers")
        if sum(len(k) + len(v) for k, v in headers) > limits.max_header_bytes:
            return HeadersTooLarge(f"request headers over {limits.max_header_bytes} bytes")
        return None

    async def serve(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        too_big = self.header_limits(headers)
        if too_big is not None:  # before anything is copied out of them
            self._count(endpoint, too_big, errors=True)
            await _send_error(send, too_big, protocol.client_request_id(None, 0), endpoint=endpoint)
            return
        authorization = client_id = length = None
        max_id = self._limits.max_request_id_chars
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == _REQUEST_ID:
                client_id = value.decode("latin-1") if len(value) <= max_id else None
            elif name == b"content-length":
                length = value
        request_id = protocol.client_request_id(client_id, max_id)
        try:
            auth.check_client(authorization, self._keys)
            raw = await self._body(receive, length)
            info, body = self._parse(endpoint, raw)
            owner = self._owner(body) if endpoint is Endpoint.RESPONSES else None
            pick = self._service.gateway_pick(headers)  # behind an EPP: its prefill and session (or a 400)
        except ClientGone:
            logger.info("request %s: the client left while sending its body", request_id)
            return
        except (BadRequest, Unauthorized) as refused:
            self._count(endpoint, refused, errors=True)
            await _send_error(send, refused, request_id, endpoint=endpoint)
            return
        client_headers = (
            {k.decode("latin-1"): v.decode("latin-1") for k, v in headers} if self._service.wants_headers else {}
        )
        if pick is not None and pick.session is not None and self._service.wants_headers:
            client_headers[SESSION_HEADER] = pick.session  # the session the gateway's header names
        request = ClientRequest(
            body=body,
            info=info,
            record=self._service.new_record(request_id, info),
            headers=client_headers,
            prefill=None if pick is None or pick.prefill is None else pick.prefill.id,
            owner=owner,
            trace=None if self._tracing is None else _start_trace(self._tracing, headers, endpoint, body, request_id),
        )
        prompts = protocol.batch_of(body) if endpoint is Endpoint.COMPLETIONS else None
        batched = prompts if prompts is not None and len(prompts) > 1 else None
        try:
            if batched is None:
                async with self._service.admission.slot():
                    await self._watched(receive, send, request)
            else:
                async with contextlib.AsyncExitStack() as slots:
                    for _ in batched:  # a batch holds a slot per prompt
                        await slots.enter_async_context(self._service.admission.slot())
                    await self._watched(receive, send, request, batched)
        except Overloaded as refused:
            self._count(endpoint, refused, errors=False)
            if request.trace is not None:
                request.trace.end(refused.kind, status=refused.http_status)
            await _send_error(send, refused, request_id, endpoint=endpoint)

    async def _body(self, receive: Receive, length: bytes | None) -> bytes:
        limit, deadline = self._limits.max_body_bytes, self._timeouts.client_body
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(deadline):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"the request body is over {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {deadline:g} s") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _owner(self, body: dict[str, Any]) -> str | None:
        """The decode worker that holds a Responses request's `previous_response_id` (404 when none does)."""
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        owner = responses.owner_of(previous, (spec.url for spec in self._service.pool.members(Role.DECODE)))
        if owner is None:
            raise NotFound(responses.not_found(previous), param="previous_response_id")
        return owner

    def _parse(self, endpoint: Endpoint, raw: bytes) -> tuple[RequestInfo, dict[str, Any]]:
        body = protocol.decode_body(raw, self._limits.max_json_depth)
        limits = self._limits
        return protocol.parse_request(endpoint, body, max_n=limits.max_n, max_batch=limits.max_batch_prompts), body

    def _count(self, endpoint: Endpoint, error: RouterError, *, errors: bool) -> None:
        metrics = self._metrics
        if errors:
            metrics.child(metrics.errors, error.kind).inc()
        metrics.child(metrics.requests, str(endpoint), self._mode, error.kind).inc()

    async def _watched(
        self, receive: Receive, send: Send, request: ClientRequest, batched: list[Any] | None = None
    ) -> None:
        """Dispatch and relay; if the client leaves meanwhile, this task is cancelled (closing both legs)."""
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self._answer(send, request, batched)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        finally:
            watcher.cancel()

    async def _answer(self, send: Send, request: ClientRequest, batched: list[Any] | None) -> None:
        rec, endpoint = request.record, request.info.endpoint
        dispatcher = self._service.dispatcher
        try:
            if batched is None:
                answer: JsonAnswer | StreamAnswer | fanout.BatchStream = await dispatcher.handle(request)
            else:
                answer = await fanout.handle_batch(dispatcher, request, batched, self._limits.max_event_bytes)
        except RouterError as failed:
            await _send_error(send, failed, rec.request_id, rec.pairing_id, endpoint)
            return
        except Exception:
            logger.exception("request %s: internal error", rec.request_id)
            if request.trace is not None:
                request.trace.end(RouterError.kind, status=RouterError.status)
            internal = RouterError("internal error in the router")
            await _send_error(send, internal, rec.request_id, rec.pairing_id, endpoint)
            return
        ids = [(_REQUEST_ID, rec.request_id.encode()), (_PAIRING_ID, (rec.pairing_id or "").encode())]
        if isinstance(answer, JsonAnswer):
            start: Message = {"type": "http.response.start", "status": answer.status, "headers": [_JSON, *ids]}
            await send(start)
            await send({"type": "http.response.body", "body": answer.content})
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [*_STREAM, *ids]})

            async def chunk(data: bytes) -> None:
                await send({"type": "http.response.body", "body": data, "more_body": True})

            t = self._timeouts
            await answer.relay(chunk, idle=t.stream_idle, write_stall=t.client_write_stall)
            if answer.stalled:
                return  # the server closes a response it did not see end
            async with asyncio.timeout(t.client_write_stall):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await asyncio.shield(answer.aclose())


def _start_trace(
    tracing: Tracing, headers: list[tuple[bytes, bytes]], endpoint: Endpoint, body: dict[str, Any], request_id: str
) -> RequestTrace:
    """The request's server span: a child of the client's W3C trace context when it sent a valid one. Its name and
    attributes are built only when the request is sampled."""

    def describe() -> tuple[str, semconv.Attributes]:
        model = body.get("model")
        attributes = semconv.request_attributes(
            endpoint=str(endpoint),
            model=model,
            max_tokens=body.get("max_tokens", body.get("max_completion_tokens")),
            request_id=request_id,
        )
        return semconv.server_span_name(str(endpoint), model), attributes

    return tracing.begin(trace_context.read(headers), describe)


async def _send_error(
    send: Send,
    error: RouterError,
    request_id: str | None,
    pairing_id: str | None = None,
    endpoint: Endpoint = Endpoint.CHAT,
) -> None:
    headers = [_JSON]
    if request_id:
        headers.append((_REQUEST_ID, request_id.encode()))
    if pairing_id:
        headers.append((_PAIRING_ID, pairing_id.encode()))
    for name, value in _extra_headers(error).items():
        headers.append((name.encode(), value.encode()))
    if isinstance(error, UpstreamError) and error.http_status >= 500:
        logger.warning("request %s failed: %s", request_id, error)
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": api_of(endpoint).error_body(error)})


def _extra_headers(error: RouterError) -> dict[str, str]:
    if isinstance(error, Overloaded):
        return {"retry-after": str(error.retry_after)}
    if isinstance(error, Unauthorized):
        return {"www-authenticate": "Bearer"}
    if isinstance(error, PayloadTooLarge | RequestTimeout | HeadersTooLarge):
        return {"connection": "close"}  # what the client still sends is not read: drop the connection
    return {}


def _error_response(error: RouterError) -> Response:
    return Response(
        error.to_json(), status_code=error.http_status, media_type="application/json", headers=_extra_headers(error)
    )


def _error_handlers(app: FastAPI, service: Service) -> None:
    @app.exception_handler(RouterError)
    async def router_error(request: Request, error: RouterError) -> Response:
        service.metrics.errors.labels(error.kind).inc()
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 404:
            return _error_response(NotFound(f"no route {request.method} {request.url.path}"))
        if error.status_code == 405:
            return _error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        failed = BadRequest(str(error.detail))
        return Response(failed.to_json(), status_code=error.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        return _error_response(BadRequest("invalid query parameters"))


def _openai_routes(app: FastAPI, service: Service) -> None:
    keys = service.settings.api_keys

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    @app.post("/v1/responses")
    async def hot_route() -> Response:  # POSTs never get here (RouterApp serves them); other methods get 405
        raise AssertionError("served by HotPath")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth.check_client(request.headers.get("authorization"), keys)
        return Response(await service.models(), media_type="application/json")

    async def helper(request: Request) -> Response:  # vLLM's /tokenize, /detokenize, /version (router/passthrough.py)
        auth.check_client(request.headers.get("authorization"), keys)
        limit = service.settings.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        body = await request.body()
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        deadline = service.settings.timeouts.helper
        path = request.url.path
        status, content = await passthrough.forward(service.pool, service.client, request.method, path, body, deadline)
        return Response(content, status_code=status, media_type="application/json")

    app.add_api_route("/tokenize", helper, methods=["POST"])
    app.add_api_route("/detokenize", helper, methods=["POST"])
    app.add_api_route("/version", helper, methods=["GET"])
    app.add_api_route("/v1/messages/count_tokens", helper, methods=["POST"])  # Anthropic's token count

    async def stored(request: Request, response_id: str) -> Response:  # a stored response, on its decode alone
        auth.check_client(request.headers.get("authorization"), keys)
        owner = responses.owner_of(response_id, (spec.url for spec in service.pool.members(Role.DECODE)))
        if owner is None:
            raise NotFound(responses.not_found(response_id), param="response_id")
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        deadline = service.settings.timeouts.helper
        status, content, kind = await passthrough.to_owner(service.client, owner, request.method, path, deadline)
        return Response(content, status_code=status, media_type=kind)

    app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", stored, methods=["POST"])


def _operations_routes(app: FastAPI, service: Service) -> None:
    keys = service.settings.api_keys

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
    async def prometheus(request: Request) -> Response:
        content, content_type = service.metrics.render(request.headers.get("accept", ""))
        return Response(content, media_type=content_type)

    @app.get("/debug/timings")
    async def debug_timings(
        request: Request, request_id: str | None = None, pairing_id: str | None = None
    ) -> dict[str, Any]:
        auth.check_client(request.headers.get("authorization"), keys)
        return {"requests": service.timings.query(request_id=request_id, pairing_id=pairing_id)}


def _admin_routes(app: FastAPI, service: Service) -> None:
    admin_key = service.settings.admin_key

    def check(request: Request) -> None:
        auth.check_admin(request.headers.get("authorization"), admin_key)

    @app.get("/admin/workers")
    async def admin_list(request: Request) -> dict[str, Any]:
        check(request)
        return {"workers": service.pool.snapshot()}

    @app.post("/admin/workers")
    async def admin_add(request: Request) -> Response:
        check(request)
        added, url = await service.add_worker(await _json_object(request))
        return JSONResponse({"added": added, "url": url}, status_code=201 if added else 200)

    @app.post("/admin/workers/drain")
    async def admin_drain(request: Request) -> dict[str, Any]:
        check(request)
        url = _url_of(await _json_object(request))
        if not service.pool.drain(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"draining": url}

    @app.post("/admin/workers/remove")
    async def admin_remove(request: Request) -> dict[str, Any]:
        check(request)
        url = _url_of(await _json_object(request))
        if not service.remove_worker(url):
            raise BadRequest(f"no worker {url!r} in the pool")
        return {"removed": url}


async def _json_object(request: Request) -> dict[str, Any]:
    body = protocol.decode_body(await request.body(), 16)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _url_of(body: dict[str, Any]) -> str:
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required")
    return url.rstrip("/")
