"""The seam of the legs: what the dispatcher asks of a transport to workers. Pure.

- `LegTransport` carries the two legs of every client request (the hot path): `post(url, body, headers)` gives
  a `LegResponse` once status and headers are in.
- The implementations sit beside this module (httpx's `_transports/` layout) and import nothing from it: they
  satisfy the Protocols structurally. `Http1Legs` (router/legs/http1.py, router/legs/http1_pool.py), this
  project's own HTTP/1.1 client, in production (router/upstream.py `make_legs`); `HttpxLegs`
  (router/legs/httpx.py) over any httpx transport (tests: httpx.MockTransport), so both run the same dispatcher
  code.

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
