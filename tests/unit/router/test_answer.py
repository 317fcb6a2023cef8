"""The first events of a decode stream: what counts as its first byte."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from router import responses
from router.answer import read_first_events
from router.errors import UpstreamError
from router.sse import EventFramer

CREATED = b'event: response.created\ndata: {"sequence_number": 0}\n\n'
PROGRESS = b'event: response.in_progress\ndata: {"sequence_number": 1}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"sequence_number": 2}\n\n'


class Chunks:
    """A LegResponse that hands out `chunks` one by one."""

    status = 200
    content_type = "text/event-stream"

    def __init__(self, *chunks: bytes) -> None:
        self._chunks = chunks
        self.read_count = 0

    async def read(self) -> bytes:
        return b"".join(self._chunks)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        for chunk in self._chunks:
            self.read_count += 1
            yield chunk

    async def aclose(self) -> None:
        return None


async def test_held_events_are_read_past_and_kept_in_order() -> None:
    response = Chunks(CREATED, PROGRESS + DELTA[:10], DELTA[10:], b"rest")
    first, rest = await read_first_events(response, EventFramer(), worker="d0", held=responses.held)
    assert first == [CREATED, PROGRESS, DELTA] and response.read_count == 3
    assert [chunk async for chunk in rest] == [b"rest"]


async def test_without_a_hold_the_first_whole_event_is_the_first_byte() -> None:
    response = Chunks(CREATED, PROGRESS)
    first, _ = await read_first_events(response, EventFramer(), worker="d0")
    assert first == [CREATED] and response.read_count == 1


async def test_a_stream_that_ends_after_only_held_events_failed_before_its_first_byte() -> None:
    for chunks in ((CREATED, PROGRESS), ()):
        with pytest.raises(UpstreamError):  # retryable: nothing reached the client
            await read_first_events(Chunks(*chunks), EventFramer(), worker="d0", held=responses.held)
