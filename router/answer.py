"""What a dispatch hands back to the HTTP layer: a whole JSON answer, or a primed decode stream to relay."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from router.errors import RouterError, UpstreamError
from router.sse import EventFramer, error_event
from router.upstream import translate

logger = logging.getLogger("kvpush.answer")


@dataclass
class JsonAnswer:
    """The decode worker's whole answer, relayed byte for byte."""

    status: int
    content: bytes


class StreamAnswer:
    """A decode stream whose status is 2xx and whose first event has arrived.

    Iterate `events()` to relay the rest one event at a time; `aclose()` must always be called (the HTTP layer
    does so in `finally`): it closes the upstream response, which makes vLLM abort the request if it is still
    running, releases the in-flight counters and reports the outcome exactly once.
    """

    def __init__(
        self,
        response: httpx.Response,
        first: list[bytes],
        chunks: AsyncIterator[bytes],
        framer: EventFramer,
        *,
        worker: str,
        cleanup: contextlib.AsyncExitStack,
        on_close: Callable[[str], None],
    ) -> None:
        self._response = response
        self._first = first
        self._chunks = chunks
        self._framer = framer
        self._worker = worker
        self._cleanup = cleanup
        self._on_close = on_close
        self._outcome = "client_gone"  # until the stream is read to its end
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        for event in self._first:
            yield event
        try:
            async for chunk in self._chunks:
                for event in self._framer.feed(chunk):
                    yield event
        except (httpx.HTTPError, TimeoutError) as exc:
            error: RouterError = translate(exc, leg="decode", worker=self._worker)
            logger.warning("decode stream broke after the first event: %s", error.message)
            self._outcome = f"stream_{error.kind}"
            yield error_event(error)
            return
        rest = self._framer.flush()
        if rest.strip():
            yield rest
        self._outcome = "ok"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        except httpx.HTTPError as exc:
            logger.debug("closing the decode stream: %s", exc)
        finally:
            await self._cleanup.aclose()
            self._on_close(self._outcome)


async def read_first_events(
    response: httpx.Response, framer: EventFramer, *, worker: str
) -> tuple[list[bytes], AsyncIterator[bytes]]:
    """Reads until at least one whole event has arrived; returns it and the iterator for the rest."""
    chunks = response.aiter_raw()
    try:
        async for chunk in chunks:
            events = framer.feed(chunk)
            if events:
                return events, chunks
    except httpx.HTTPError as exc:
        raise translate(exc, leg="decode", worker=worker) from exc
    rest = framer.flush()
    if rest.strip():
        return [rest], chunks
    raise UpstreamError("closed the stream before sending anything", leg="decode", worker=worker)
