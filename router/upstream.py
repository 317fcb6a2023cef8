"""The httpx seam to workers: one client with explicit limits and deadlines, and httpx errors → router errors."""

from __future__ import annotations

import json
from typing import Any

import httpx

from router.config import Settings
from router.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatus,
    UpstreamTimeout,
)
from router.transport import AiohttpTransport


def make_client(settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The one client for every worker call. Per-call deadlines are tighter; these bound every read."""
    t = settings.timeouts
    timeout = httpx.Timeout(connect=t.connect, read=t.stream_idle, write=t.connect, pool=t.connect)
    if transport is None:
        transport = AiohttpTransport(max_connections=settings.max_connections)
    return httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)


def translate(exc: Exception, *, leg: str, worker: str) -> UpstreamError:
    """The router error for an httpx failure on `leg` to `worker`."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return UpstreamTimeout(f"no answer in time ({type(exc).__name__})", leg=leg, worker=worker)
    if isinstance(exc, httpx.ConnectError):
        return UpstreamConnectError(f"cannot connect ({exc})", leg=leg, worker=worker)
    if isinstance(exc, httpx.TransportError):
        return UpstreamConnectError(f"connection failed ({type(exc).__name__}: {exc})", leg=leg, worker=worker)
    return UpstreamProtocolError(f"{type(exc).__name__}: {exc}", leg=leg, worker=worker)


async def post_json(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], *, leg: str, worker: str
) -> tuple[bytes, dict[str, Any]]:
    """POST a JSON body and return the raw answer and its parsed object; any failure is an UpstreamError."""
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise translate(exc, leg=leg, worker=worker) from exc
    if not response.is_success:
        raise UpstreamStatus(response.status_code, response.content, leg=leg, worker=worker)
    try:
        parsed = json.loads(response.content)
    except ValueError:
        raise UpstreamProtocolError("answered with a body that is not JSON", leg=leg, worker=worker) from None
    if not isinstance(parsed, dict):
        raise UpstreamProtocolError("answered with JSON that is not an object", leg=leg, worker=worker)
    return response.content, parsed


async def open_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], *, leg: str, worker: str
) -> httpx.Response:
    """POST and return the response once its status and headers are in; a non-2xx is read, closed and raised."""
    request = client.build_request("POST", url, json=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise translate(exc, leg=leg, worker=worker) from exc
    if response.is_success:
        return response
    try:
        content = await response.aread()
    except httpx.HTTPError:
        content = b""
    finally:
        await response.aclose()
    raise UpstreamStatus(response.status_code, content, leg=leg, worker=worker)
