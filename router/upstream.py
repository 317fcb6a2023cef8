"""Calls to workers: the leg calls over the LegTransport seam, the httpx client for everything else, and every
transport failure → a router error that names the role to the client and the worker and cause to the log."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import msgspec

from router.aiohttp_transport import AiohttpTransport
from router.config import Settings
from router.domain import Role
from router.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamTimeout,
)
from router.legs.base import LegResponse, LegTransport
from router.legs.http1_pool import Http1Legs

_decode = msgspec.json.Decoder().decode


def make_client(settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The client for probes, scrapes and /v1/models; each call passes its own deadline."""
    t = settings.timeouts
    timeout = httpx.Timeout(t.health, connect=t.connect)
    if transport is None:
        transport = AiohttpTransport(max_connections=64)
    return httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)


def make_legs(settings: Settings) -> LegTransport:
    """The legs' client: this project's HTTP/1.1 client (router/legs/http1_pool.py; router/README.md, "The legs'
    client")."""
    return Http1Legs(max_connections=settings.max_connections, connect_timeout=settings.timeouts.connect)


def translate(exc: BaseException, *, leg: Role | str, worker: str) -> UpstreamError:
    """The router error for a transport failure on `leg` to `worker`; `detail` (logs only) keeps the cause."""
    if isinstance(exc, UpstreamError):
        return exc
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return UpstreamTimeout("no answer in time", leg=leg, worker=worker, detail=detail)
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectError("cannot connect", leg=leg, worker=worker, detail=detail)
    if isinstance(exc, httpx.TransportError):
        return UpstreamConnectError("the connection failed", leg=leg, worker=worker, detail=detail)
    return UpstreamProtocolError("answered something unusable", leg=leg, worker=worker, detail=detail)


async def post_json(
    legs: LegTransport, url: str, body: bytes, headers: Mapping[str, str], *, leg: Role, worker: str
) -> tuple[bytes, Any]:
    """POST a JSON body; the raw answer and its parsed object. Any failure is an UpstreamError."""
    try:
        response = await legs.post(url, body, headers)
        content = await response.read()
    except httpx.HTTPError as exc:
        raise translate(exc, leg=leg, worker=worker) from exc
    if not 200 <= response.status < 300:
        raise UpstreamStatus(response.status, content, leg=leg, worker=worker)
    try:
        parsed = _decode(content)
    except (msgspec.DecodeError, ValueError):
        raise UpstreamProtocolError("answered with a body that is not JSON", leg=leg, worker=worker) from None
    if not isinstance(parsed, dict):
        raise UpstreamProtocolError("answered with JSON that is not an object", leg=leg, worker=worker)
    return content, parsed


async def open_stream(
    legs: LegTransport, url: str, body: bytes, headers: Mapping[str, str], *, leg: Role, worker: str
) -> LegResponse:
    """POST and return the response once a 2xx event-stream status is in; anything else is read, closed, raised."""
    try:
        response = await legs.post(url, body, headers)
    except httpx.HTTPError as exc:
        raise translate(exc, leg=leg, worker=worker) from exc
    if 200 <= response.status < 300 and response.content_type.startswith("text/event-stream"):
        return response
    try:
        content = await response.read()
    except httpx.HTTPError:
        content = b""
    finally:
        await response.aclose()
    if 200 <= response.status < 300:
        raise UpstreamProtocolError(
            f"answered a streamed request with {response.content_type or 'no content type'}, not an event stream",
            leg=leg,
            worker=worker,
        )
    raise UpstreamStatus(response.status, content, leg=leg, worker=worker)
