"""SSE framing: events come out whole, one for one, whatever the chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.errors import UpstreamTimeout
from router.sse import EventFramer, EventTooLarge, RelayCheck, error_event, error_of, payload_of

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


def test_an_event_over_the_bound_fails_framing_whatever_the_chunking() -> None:
    framer = EventFramer(max_event_bytes=1000)
    assert framer.feed(b"data: ok\n\n" + b"x" * 600) == [b"data: ok\n\n"]
    with pytest.raises(EventTooLarge):
        framer.feed(b"y" * 600)


def test_many_events_in_one_chunk_and_separators_split_across_chunks() -> None:
    stream = b"".join(f"data: {i}\n\n".encode() for i in range(2000))
    framer = EventFramer(max_event_bytes=64)
    out = framer.feed(stream[:7]) + framer.feed(stream[7:9]) + framer.feed(stream[9:])
    assert len(out) == 2000 and b"".join(out) == stream


def test_the_relay_check_bounds_the_open_event_across_chunks() -> None:
    check = RelayCheck(max_event_bytes=100)
    check.feed(b"data: " + b"a" * 80 + b"\n")
    check.feed(b"\ndata: " + b"b" * 80)  # the separator straddles the two chunks: the first event ended
    with pytest.raises(EventTooLarge):
        check.feed(b"b" * 30)


def test_the_relay_check_keeps_the_last_usage() -> None:
    check = RelayCheck(max_event_bytes=2**20)
    check.feed(b'data: {"choices": [{"text": "a"}], "usage": null}\n\n')
    assert check.usage() is None
    check.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n')
    assert check.usage() == {"prompt_tokens": 3}


def test_an_event_led_event_has_its_data_lines_payload() -> None:
    event = b'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 2}}\n\n'
    assert payload_of(event) == {"type": "message_delta", "usage": {"output_tokens": 2}}
    assert payload_of(b"event: ping\n\n") is None
    assert error_of(event) is None


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "m1"}}\n\n', "m1"),
        (b'event: error\ndata: {"type": "error", "code": "x", "message": "m2", "sequence_number": 3}\n\n', "m2"),
        (b'data: {"error": {"message": "m3"}}\n\n', "m3"),
    ],
    ids=["anthropic", "responses", "openai"],
)
def test_error_of_reads_each_apis_in_band_error(event: bytes, message: str) -> None:
    assert error_of(event) == message
