import asyncio
import json
from collections.abc import Callable, Iterator

import httpx

from loadtest.client import RequestSpec, StreamTracker, payload, send
from loadtest.records import ClientRecord


def sse(*events: object) -> list[str]:
    lines = []
    for e in events:
        lines += [f"data: {e if isinstance(e, str) else json.dumps(e)}", ""]
    return lines


def comp(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


def test_payload_shapes() -> None:
    c = payload(RequestSpec("completions", "m", "hi", 4))
    assert c["prompt"] == "hi" and c["max_tokens"] == 4 and c["ignore_eos"] is True
    assert c["stream_options"] == {"include_usage": True}
    ch = payload(RequestSpec("chat", "m", "hi", 4))
    assert ch["messages"] == [{"role": "user", "content": "hi"}] and ch["max_completion_tokens"] == 4


def test_tracker_times_first_chunk_gaps_and_usage() -> None:
    t = StreamTracker(ClientRecord(0, "r"), t_send=10.0)
    times = iter([10.2, 10.2, 10.5, 10.5, 10.6, 10.6, 10.9, 10.9, 11.0, 11.0])
    for line in sse(comp(""), comp("a"), comp("b"), USAGE, "[DONE]"):
        t.feed(line, next(times))
    r = t.finish(expect_output=3)
    assert r.ok and t.done
    assert abs((r.ttft_s or 0) - 0.2) < 1e-9 and abs((r.ttft_text_s or 0) - 0.5) < 1e-9
    assert [round(g, 6) for g in r.itl_s] == [0.3, 0.1]
    assert abs((r.e2e_s or 0) - 0.6) < 1e-9  # the usage chunk does not move the end time
    assert (r.prompt_tokens, r.output_tokens, r.chunks) == (7, 3, 3)


def test_tracker_chat_deltas_and_failures() -> None:
    t = StreamTracker(ClientRecord(0, "r"), t_send=0.0)
    for i, line in enumerate(
        sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, {"choices": [{"delta": {"content": "x"}}]})
    ):
        t.feed(line, float(i))
    assert t.rec.ttft_s == 0.0 and t.rec.ttft_text_s == 2.0
    assert t.finish(expect_output=2).error == "no usage chunk"
    wrong = StreamTracker(ClientRecord(1, "r"), 0.0)
    for line in sse(comp("a"), USAGE):
        wrong.feed(line, 1.0)
    assert not wrong.finish(expect_output=4).ok


def run_send(handler: httpx.MockTransport) -> ClientRecord:
    clock: Iterator[float] = iter(float(i) for i in range(1000))

    async def go() -> ClientRecord:
        async with httpx.AsyncClient(transport=handler) as client:
            return await send(
                client,
                "http://t/v1/completions",
                {"prompt": "p"},
                ClientRecord(0, "mine"),
                lambda: next(clock),
                timeout_s=5.0,
                expect_output=3,
            )

    return asyncio.run(go())


def test_send_streams_and_reads_router_headers() -> None:
    body = "\n".join(sse(comp("a"), comp("b"), comp("c"), USAGE, "[DONE]")).encode()

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.headers["x-request-id"] == "mine"
        return httpx.Response(200, content=body, headers={"x-request-id": "mine", "x-kvpush-pairing-id": "pp"})

    r = run_send(httpx.MockTransport(handler))
    assert r.ok and r.status == 200 and r.pairing_id == "pp" and r.output_tokens == 3


def test_send_records_http_errors_and_transport_failures() -> None:
    r = run_send(httpx.MockTransport(lambda req: httpx.Response(503, text="busy")))
    assert not r.ok and r.error is not None and r.error.startswith("HTTP 503")

    def boom(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    r = run_send(httpx.MockTransport(boom))
    assert not r.ok and r.error is not None and "ConnectError" in r.error


def test_send_adds_the_caller_s_headers_and_lets_it_read_every_line_and_fail_on_a_bad_one() -> None:
    body = "\n".join(sse(comp("a"), comp("b"), comp("c"), USAGE, "[DONE]")).encode()
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.headers["x-session-id"] == "s1" and req.headers["x-request-id"] == "mine"
        return httpx.Response(200, content=body)

    async def go(listen: Callable[[str], None]) -> ClientRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            rec = ClientRecord(0, "mine")
            clock = iter(range(100))
            return await send(
                client,
                "http://x/v1",
                {},
                rec,
                lambda: next(clock),
                5.0,
                3,
                headers={"x-session-id": "s1"},
                listen=listen,
            )

    assert asyncio.run(go(seen.append)).ok
    assert [line for line in seen if line.startswith("data:")][-1] == "data: [DONE]"

    def bad(line: str) -> None:
        if line.startswith("data:"):
            json.loads("{")

    r = asyncio.run(go(bad))
    assert not r.ok and r.error is not None and r.error.startswith("bad stream")
