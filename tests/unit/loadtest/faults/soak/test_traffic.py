"""What each soak request kind may end with."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from loadtest.faults.soak.traffic import MIX, SoakAnswer, _post, expected


@pytest.mark.parametrize(
    ("kind", "label", "ok"),
    [
        ("chat-stream", "200", True),
        ("chat-stream", "200 cut", False),
        ("completion-json", "502", False),
        ("session", "200", True),
        ("session", "no answer", False),
        ("leaver", "left", True),
        ("leaver", "200 cut", False),  # the stream ended before the client could leave
        ("bad", "400", True),
        ("bad", "422", True),
        ("bad", "400 unclear", False),  # a 4xx without an OpenAI-style error body
        ("bad", "429", False),
        ("bad", "500", False),
    ],
)
def test_each_kind_has_its_expected_outcomes(kind: str, label: str, ok: bool) -> None:
    assert kind in MIX
    assert expected(kind, label) is ok


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


class _CutStream(httpx.SyncByteStream):
    """A stream that sends one event and then breaks, as a connection closed mid-body does."""

    def __iter__(self) -> Iterator[bytes]:
        yield b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_a_stream_broken_after_its_status_is_a_cut_answer_naming_the_exception_and_the_request_id() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["x-request-id"])
        return httpx.Response(200, stream=_CutStream())

    answer = _post(_client(handler), "http://soak", "/v1/chat/completions", {"stream": True})
    assert answer.label == "200 cut"
    assert seen[0].startswith("soak-") and answer.detail.startswith(f"{seen[0]}: RemoteProtocolError: peer closed")


def test_a_connection_refused_before_any_status_is_no_answer() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    answer = _post(_client(handler), "http://soak", "/v1/completions", {"stream": False})
    assert answer.label == "no answer" and "ConnectError: connection refused" in answer.detail


def test_a_stream_without_done_is_cut_and_says_how_many_events_came() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\n')

    answer = _post(_client(handler), "http://soak", "/v1/completions", {"stream": True})
    assert (answer.label, answer.text) == ("200 cut", "a") and answer.detail.endswith("1 events, no [DONE]")


def test_a_clean_stream_is_200_with_its_text_and_no_detail() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')

    assert _post(_client(handler), "http://soak", "/v1/completions", {"stream": True}) == SoakAnswer("200", "a")
