"""The seam of the legs: what the dispatcher asks of a transport to workers, and the one the settings choose. Pure.

- `LegTransport` carries the two legs of every client request (the hot path): `post(url, body, headers)` gives
  a `LegResponse` once status and headers are in.
- The implementations sit beside this module (httpx's `_transports/` layout) and import nothing from it: they
  satisfy the Protocols structurally. `AiohttpLegs` (router/legs/aiohttp.py), straight on aiohttp (httpx's
  request and response models cost more CPU per leg than aiohttp's whole client call); `Http1Legs`
  (router/legs/http1.py, router/legs/http1_pool.py), this project's own HTTP/1.1 client; `HttpxLegs`
  (router/legs/httpx.py) over any httpx transport (tests: httpx.MockTransport), so all run the same dispatcher
  code. `legs_for` builds the one the `leg_client` setting names.

No transport puts a read timeout on a leg: every leg runs under its own deadline (router/dispatch.py), and a
transport-wide read timeout would cut those short. Errors come out as httpx's exception classes whatever
carries the bytes, so router/upstream.py maps one family. Closing a response before its end closes its
connection (the worker sees the client leave and aborts the request); one read to its end goes back to the pool.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Protocol


class LegResponse(Protocol):
    status: int
    content_type: str

    async def read(self) -> bytes:
        """The whole body; the connection is released (or dropped) after."""
        ...

    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives."""
        ...

    async def aclose(self) -> None:
        """Read to its end: back to the pool; else the connection is dropped. Idempotent."""
        ...


class LegTransport(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> LegResponse: ...

    async def aclose(self) -> None: ...


def legs_for(client: str, *, max_connections: int, connect_timeout: float) -> LegTransport:
    """The production leg transport named by the `leg_client` setting (router/config.py LEG_CLIENTS)."""
    if client == "http1":
        from router.legs.http1_pool import Http1Legs

        return Http1Legs(max_connections=max_connections, connect_timeout=connect_timeout)
    if client == "aiohttp":
        from router.legs.aiohttp import AiohttpLegs

        return AiohttpLegs(max_connections=max_connections, connect_timeout=connect_timeout)
    raise ValueError(f"unknown leg client {client!r}")
