"""What a dispatch hands back to the HTTP layer: a whole JSON answer, or a primed decode stream it owns.

A `StreamAnswer` owns everything the decode leg still holds once its first event is in: the upstream response,
the decode worker's in-flight count and the request's record. `aclose()` (always called, once or more) releases
all three exactly once. The stream is relayed byte for byte after the first event (no re-framing); `RelayCheck`
only bounds the open event and keeps the usage chunk. The one exception: when the router asked decode for the
token ids the client did not ask for (the decider checks what decode's cache will match), whole events are
relayed with those ids scrubbed back to what the client would have had (`Collect.scrub`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.apis import OPENAI, Api
from router.domain import Role
from router.errors import RouterError, UpstreamError, UpstreamProtocolError, UpstreamTimeout
from router.legs.base import LegResponse
from router.sse import EventFramer, EventTooLarge, RelayCheck, payload_of
from router.upstream import translate
from router.usage import CachedFix, fixed_usage

logger = logging.getLogger("kvpush.answer")


@dataclass
class JsonAnswer:
    """The decode worker's whole answer, relayed byte for byte; everything it held is released already."""

    status: int
    content: bytes


@dataclass
class StreamEnd:
    """How a relayed stream ended, for the record and the decider."""

    outcome: str
    usage: dict[str, Any] | None = None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None  # the generated ids, when they were asked for and came


@dataclass(frozen=True)
class Collect:
    """What a stream's decider wants of it: the text of an event; its token ids; the scrub of an event whose
    ids the client did not ask for (None: relay the bytes as they come)."""

    text_of: Callable[[Any], str | None]
    ids_of: Callable[[Any], list[int] | None] | None = None
    scrub: Callable[[bytes], bytes] | None = None


@dataclass
class _Collected:
    framer: EventFramer
    parts: list[str | None] = field(default_factory=list)  # None: a chunk carried output its text lacks
    ids: list[int] = field(default_factory=list)
    saw_ids: bool = False

    def text(self) -> str | None:
        return None if any(part is None for part in self.parts) else "".join(p for p in self.parts if p)


class StreamAnswer:
    """A decode stream whose status is 2xx and whose first event has arrived (and was not an error).

    `relay(send, ...)` or `events()` hand on the rest; `aclose()` must always be called: it closes the upstream
    response (vLLM aborts a request whose client left), releases the in-flight count and reports the end once.
    """

    def __init__(
        self,
        response: LegResponse,
        first: list[bytes],
        chunks: AsyncGenerator[bytes, None],
        framer: EventFramer,
        check: RelayCheck,
        *,
        worker: str,
        cleanup: contextlib.AsyncExitStack,
        on_close: Callable[[StreamEnd], None],
        collect: Collect | None = None,
        api: Api = OPENAI,
    ) -> None:
        self._api = api  # its in-band error event and usage rule (router/apis.py)
        self._last = b""  # the last chunk relayed (a Responses error event is numbered after it)
        self._response = response
        self._first = first
        self._framer = framer
        self._chunks = chunks
        self._check = check
        self._worker = worker
        self._cleanup = cleanup
        self._on_close = on_close
        self._collect = None if collect is None else (_Collected(EventFramer()), collect)
        self._outcome = "client_gone"  # until the stream is read to its end
        self._closed = False
        self._fix: CachedFix | None = None

    def fix_cached(self, fix: CachedFix) -> None:
        """Relays the stream with its cached counts rewritten to P's (router/usage.py); set before the relay."""
        self._fix = fix

    @property
    def stalled(self) -> bool:
        """The client took nothing for the write-stall bound: its response was cut."""
        return self._outcome == "client_stalled"

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The first events, then the upstream bytes as they come; a broken stream ends with an error event."""
        # the first read as one chunk, as it arrived: its whole events and the start of the next one
        rest = self._framer.flush()
        first = b"".join(self._first) + rest
        self._check.feed(first)
        fix = self._fix
        if fix is not None:
            first = await _fixed(fix, first)
        if out := self._observe(first):
            yield out
        try:
            async for chunk in self._chunks:
                self._check.feed(chunk)
                if fix is not None:  # inline: no coroutine per chunk
                    fed = fix.feed(chunk)
                    if fed is None:
                        await fix.resolve()
                        fed = fix.feed(b"")
                    chunk = fed or b""
                self._last = chunk
                if out := self._observe(chunk):
                    yield out
        except (httpx.HTTPError, EventTooLarge) as exc:
            yield self._broke(exc)
            return
        if fix is not None and (tail := await fix.flush()):
            yield self._observe(tail)
        if self._collect is not None and (scrub := self._collect[1].scrub) is not None:
            tail = self._collect[0].framer.flush()  # an unterminated last event
            if tail:
                yield scrub(tail)
        self._outcome = "ok"

    async def relay(self, send: Callable[[bytes], Awaitable[None]], *, idle: float, write_stall: float) -> None:
        """Hands every chunk to `send`: at most `idle` s waiting for the worker, `write_stall` s for the client.

        A silent worker ends the stream with an in-band timeout error; a client that takes nothing for
        `write_stall` s is cut (then the caller's aclose() closes both legs)."""
        events = self.events()
        now = asyncio.get_running_loop().time
        reading = True
        try:
            async with asyncio.timeout_at(now() + idle) as deadline:
                while True:
                    reading = True
                    deadline.reschedule(now() + idle)
                    try:
                        chunk = await anext(events)
                    except StopAsyncIteration:
                        return
                    reading = False
                    deadline.reschedule(now() + write_stall)
                    await send(chunk)
        except TimeoutError:
            if not reading:
                self._outcome = "client_stalled"
                logger.info("a streaming client took nothing for %g s: stream and legs closed", write_stall)
                return
        finally:
            await events.aclose()
        failure = UpstreamTimeout(f"no event for {idle:g} s", leg=Role.DECODE, worker=self._worker)
        logger.warning("decode stream went silent after the first event: %s", failure)
        self._outcome = f"stream_{failure.kind}"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(write_stall):
                await send(self._api.error_event(failure, self._last))

    def _broke(self, exc: Exception) -> bytes:
        error: RouterError
        if isinstance(exc, EventTooLarge):
            error = UpstreamProtocolError(str(exc), leg=Role.DECODE, worker=self._worker)
        else:
            error = translate(exc, leg=Role.DECODE, worker=self._worker)
        logger.warning("decode stream broke after the first event: %s", error)
        self._outcome = f"stream_{error.kind}"
        return self._api.error_event(error, self._last)

    def _observe(self, chunk: bytes) -> bytes:
        """The bytes to relay for `chunk`: itself, or its whole events scrubbed (see `Collect`)."""
        if self._collect is None:
            return chunk
        collected, want = self._collect
        events = collected.framer.feed(chunk)
        for event in events:
            payload = payload_of(event)
            collected.parts.append(want.text_of(payload))
            if want.ids_of is not None and (ids := want.ids_of(payload)) is not None:
                collected.ids += ids
                collected.saw_ids = True
        if want.scrub is None:
            return chunk
        return b"".join(want.scrub(event) for event in events)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._chunks.aclose()
            await self._response.aclose()
        except httpx.HTTPError as exc:
            logger.debug("closing the decode stream: %s", exc)
        finally:
            await self._cleanup.aclose()
            text = ids = None
            if self._collect is not None:
                collected = self._collect[0]
                text, ids = collected.text(), tuple(collected.ids) if collected.saw_ids else None
            usage = self._check.usage()
            if self._fix is not None and self._fix.resolved:
                usage = fixed_usage(usage, self._fix.cached)
            self._on_close(StreamEnd(self._outcome, usage, text, ids))


async def _fixed(fix: CachedFix, chunk: bytes) -> bytes:
    """`chunk` through `fix`, P's count awaited first when it holds a count."""
    out = fix.feed(chunk)
    if out is None:
        await fix.resolve()
        out = fix.feed(b"")
    return out or b""


async def read_first_events(
    response: LegResponse, framer: EventFramer, *, worker: str, held: Callable[[bytes], bool] | None = None
) -> tuple[list[bytes], AsyncGenerator[bytes, None]]:
    """Reads until at least one whole event has arrived (one that `held` does not hold back: events an API sends
    before the engine has done anything); returns the events so far and the iterator for the rest."""
    chunks = response.chunks()
    events: list[bytes] = []
    try:
        async for chunk in chunks:
            events += framer.feed(chunk)
            if events and (held is None or not all(held(event) for event in events)):
                return events, chunks
    except httpx.HTTPError as exc:
        raise translate(exc, leg=Role.DECODE, worker=worker) from exc
    except EventTooLarge as exc:
        raise UpstreamProtocolError(str(exc), leg=Role.DECODE, worker=worker) from None
    rest = framer.flush()
    if rest.strip():
        return [*events, rest], chunks
    raise UpstreamError("closed the stream before sending anything", leg=Role.DECODE, worker=worker)


async def true_cached(
    answer: JsonAnswer | StreamAnswer,
    client_body: Mapping[str, Any],
    cached: Callable[[], Awaitable[int | None]],
    api: Api = OPENAI,
) -> JsonAnswer | StreamAnswer:
    """Decode's answer with its cached counts made P's (router/usage.py), as `api` states them: a JSON answer
    now, a stream as it is relayed, and only when the client gets usage at all (a stream without it costs
    nothing)."""
    if not api.wants_usage(client_body):
        return answer
    if isinstance(answer, StreamAnswer):
        answer.fix_cached(CachedFix(cached, api.with_cached, api.cached_marker))
        return answer
    if api.cached_marker not in answer.content:
        return answer
    return JsonAnswer(answer.status, api.with_cached(answer.content, await cached()))


def known(cached: int | None) -> Callable[[], Awaitable[int | None]]:
    """An already known count, as `true_cached` takes it."""

    async def known() -> int | None:
        return cached

    return known
