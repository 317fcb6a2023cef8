"""Legs over an httpx client (`HttpxLegs`; tests: httpx.MockTransport), with the same semantics as Http1Legs."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import httpx


class _HttpxLeg:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._raw: AsyncIterator[bytes] | None = None
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        finally:
            await self._response.aclose()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        self._raw = self._response.aiter_raw()
        async for chunk in self._raw:
            yield chunk

    async def aclose(self) -> None:
        raw, self._raw = self._raw, None
        if isinstance(raw, AsyncGenerator):
            await raw.aclose()
        # `async for` never closes what it iterates, and httpx's stream wrappers keep the body's own iterator
        # (a MockTransport handler's generator): close it, as Http1Legs closes the connection
        inner: object = self._response.stream
        for _ in range(4):
            inner = getattr(inner, "_stream", None)
            if isinstance(inner, AsyncGenerator):
                await inner.aclose()
                break
        await self._response.aclose()


class HttpxLegs:
    """Legs over an httpx client (tests: httpx.MockTransport), with the same semantics as Http1Legs."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> _HttpxLeg:
        request = self._client.build_request("POST", url, content=body, headers=headers)
        return _HttpxLeg(await self._client.send(request, stream=True))

    async def aclose(self) -> None:
        return None
