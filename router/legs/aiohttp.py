"""The legs and the router's other worker calls over aiohttp's connection pool.

- `AiohttpLegs`: the production leg transport (router/legs/base.py's `LegTransport`).
- `AiohttpTransport`, an httpx transport, carries everything else (health probes, scrapes, /v1/models).
  httpcore's pool scans every pooled connection (a poll() syscall each) whenever a request starts or ends,
  which at tens of connections cost more CPU than the rest of a request; aiohttp's pool does not.

aiohttp's exceptions come out as httpx's (router/upstream.py maps one family).
"""

from __future__ import annotations

import asyncio
import functools
import io
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import cast

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler

_LARGE_BODY = 2**20


def _client_error(exc: BaseException, during: str) -> httpx.HTTPError:
    """aiohttp's exception as the httpx one router/upstream.py maps."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(f"no connection in time: {exc}")
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(f"{during}: timed out: {exc}")
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ClientOSError):
        return httpx.ConnectError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(f"server disconnected: {exc}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(f"incomplete body: {exc}")
    return httpx.ReadError(f"{type(exc).__name__}: {exc}")


class _AiohttpLeg:
    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except aiohttp.ClientError as exc:
            raise _client_error(exc, "reading the answer") from exc
        finally:
            self._close()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise _client_error(exc, "reading the stream") from exc

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class _AbortingHandler(ResponseHandler):
    """aiohttp's connection protocol, except that closing a connection aborts it. A plain close waits for the
    write buffer to drain first, so a leg cancelled while a worker never reads its large body kept its socket
    (and the buffered body) forever; a released keep-alive connection is never closed, so nothing else changes."""

    def close(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()
        super().close()


class AiohttpLegs:
    """The production leg transport: one aiohttp session (made in the running loop on first use), its pool
    sized by `max_connections` and kept alive `keepalive` s (under uvicorn's 5 s default, so an idle pooled
    connection is never one the worker is closing)."""

    def __init__(self, *, max_connections: int, connect_timeout: float, keepalive: float = 4.0) -> None:
        self._max_connections = max_connections
        self._keepalive = keepalive
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=None)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive,
                use_dns_cache=True,
                ttl_dns_cache=10,
            )
            # aiohttp has no option for this; its connector builds protocols with `_factory` (aiohttp 3.x)
            factory = functools.partial(_AbortingHandler, loop=asyncio.get_running_loop())
            connector._factory = cast("functools.partial[ResponseHandler]", factory)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                timeout=self._timeout,
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> _AiohttpLeg:
        # past aiohttp's 1 MiB mark a body is written in chunks that wait for the socket (and no warning)
        data: bytes | io.BytesIO = body if len(body) <= _LARGE_BODY else io.BytesIO(body)
        try:
            response = await self._get_session().post(url, data=data, headers=headers, allow_redirects=False)
        except aiohttp.ClientError as exc:
            raise _client_error(exc, "sending the request") from exc
        return _AiohttpLeg(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise httpx.ReadTimeout(f"read timed out: {exc}", request=self._request) from exc
        except aiohttp.ClientPayloadError as exc:
            raise httpx.RemoteProtocolError(f"incomplete body: {exc}", request=self._request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=self._request) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # whole body read: the connection goes back to the pool
        else:
            self._response.close()  # cut short: drop the connection, the worker sees the client leave


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session (made in the running loop on first use) for every request of one httpx client."""

    def __init__(self, *, max_connections: int, keepalive: float = 30.0) -> None:
        self._max_connections = max_connections
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=self._keepalive, use_dns_cache=True, ttl_dns_cache=10
            )
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(sock_connect=limits.get("connect"), sock_read=limits.get("read"))
        body = await request.aread()
        try:
            response = await self._get_session().request(
                request.method,
                str(request.url),
                data=body or None,
                headers=request.headers.multi_items(),
                allow_redirects=False,
                timeout=timeout,
                compress=None,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(f"no connection in time: {exc}", request=request) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise httpx.ReadTimeout(f"no answer in time: {exc}", request=request) from exc
        except (aiohttp.ClientConnectorError, aiohttp.ClientOSError) as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}", request=request) from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.RemoteProtocolError(f"server disconnected: {exc}", request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}", request=request) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
