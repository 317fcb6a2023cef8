"""`AiohttpTransport`: the httpx transport of the router's calls to workers other than the legs (health probes,
scrapes, /v1/models), over aiohttp's connection pool. The legs go over router/legs/ (`Http1Legs`).

httpcore's pool scans every pooled connection (a poll() syscall each) whenever a request starts or ends, which at
tens of connections cost more CPU than the rest of a request; aiohttp's pool does not. aiohttp's exceptions come
out as httpx's (router/upstream.py maps one family).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx


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
