"""SSE framing: events come out whole, one for one, whatever the chunking."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from router.errors import UpstreamTimeout
from router.sse import EventFramer, error_event, error_of

DONE = b"data: [DONE]\n\n"

EVENTS = [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b'data: {"b": 2}\n\n', DONE]


def test_whole_events_pass_through_one_for_one() -> None:
    framer = EventFramer()
    assert [e for chunk in EVENTS for e in framer.feed(chunk)] == EVENTS
    assert framer.flush() == b""


def test_several_events_in_one_chunk_come_out_separately() -> None:
    assert EventFramer().feed(b"".join(EVENTS)) == EVENTS


@given(st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=40))
def test_any_chunking_gives_the_same_events(cuts: list[int]) -> None:
    stream, framer, out, pos = b"".join(EVENTS), EventFramer(), [], 0
    for size in cuts:
        out += framer.feed(stream[pos : pos + size])
        pos += size
    out += framer.feed(stream[pos:])
    assert out == EVENTS


def test_crlf_separated_events_are_framed() -> None:
    assert EventFramer().feed(b"data: 1\r\n\r\ndata: 2\r\n\r\n") == [b"data: 1\r\n\r\n", b"data: 2\r\n\r\n"]


def test_an_unterminated_tail_is_returned_by_flush() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: par") == [b"data: 1\n\n"]
    assert framer.flush() == b"data: par"


def test_error_event_is_an_openai_error_object() -> None:
    event = error_event(UpstreamTimeout("slow", leg="decode", worker="http://d"))
    assert event.startswith(b"data: ")
    payload = json.loads(event[len(b"data: ") :])
    assert payload["error"]["type"] == "upstream_timeout"
    assert event.endswith(b"\n\n")


def test_error_of_finds_in_band_errors_only() -> None:
    assert error_of(b'data: {"error": {"message": "boom", "code": 500}}\n\n') == "boom"
    assert error_of(b'data: {"choices": [{"text": "error"}]}\n\n') is None
    assert error_of(b'data: {"choices": [], "error": null}\n\n') is None
    assert error_of(DONE) is None and error_of(b": ping\n\n") is None
