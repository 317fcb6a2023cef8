"""Anthropic's Messages API through the router: its checks, its error shape, its usage made true, both modes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router import messages
from router.answer import JsonAnswer, StreamAnswer
from router.app import create_app
from router.config import build_settings
from router.dispatch import ClientRequest
from router.domain import Endpoint
from router.errors import BadRequest, NoHealthyWorker, Overloaded, UpstreamTimeout
from router.protocol import parse_request, prefill_body
from router.tracing import context as w3c
from tests.unit.router.fake_workers import FakeWorkers, Handler, prefill_ok, status
from tests.unit.router.test_dispatch import call_of, make, relay
from tests.unit.router.tracing.support import in_memory

BODY = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]}
STREAM = {**BODY, "stream": True}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**BODY, "max_tokens": None}, "max_tokens"),
        ({k: v for k, v in BODY.items() if k != "max_tokens"}, "max_tokens"),
        ({**BODY, "max_tokens": 0}, "max_tokens"),
        ({**BODY, "messages": []}, "messages"),
        ({**BODY, "messages": [{"content": "x"}]}, "messages"),
        ({**BODY, "system": 3}, "system"),
        ({**BODY, "kv_transfer_params": {}}, "kv_transfer_params"),
    ],
)
def test_a_bad_messages_request_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_request(Endpoint.MESSAGES, body)
    assert refused.value.param == param


def test_a_messages_request_is_estimated_from_its_system_and_text_blocks() -> None:
    body = {**BODY, "system": "s" * 40, "messages": [{"role": "user", "content": [{"type": "text", "text": "t" * 40}]}]}
    assert parse_request(Endpoint.MESSAGES, body).prompt_tokens == 20
    assert parse_request(Endpoint.MESSAGES, {**BODY, "n": 3}).endpoint is Endpoint.MESSAGES  # no n: not checked


def test_the_prefill_leg_is_cut_to_one_token_in_anthropics_fields() -> None:
    out = prefill_body(STREAM, Endpoint.MESSAGES, "xfer-1")
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "max_completion_tokens" not in out and "stream_options" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True and STREAM["max_tokens"] == 5


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (BadRequest("bad", param="x"), 400, "invalid_request_error"),
        (Overloaded("busy"), 429, "rate_limit_error"),
        (NoHealthyWorker("none"), 503, "overloaded_error"),
        (UpstreamTimeout("late", leg="decode", worker="http://d0"), 504, "timeout_error"),
    ],
)
def test_router_errors_take_anthropics_shape(error: Any, status: int, kind: str) -> None:
    body = json.loads(messages.error_body(error))
    assert error.http_status == status
    assert body == {"type": "error", "error": {"type": kind, "message": error.to_body()["error"]["message"]}}
    assert "http://d0" not in body["error"]["message"]
    event = messages.error_event(error)
    assert event.startswith(b"event: error\ndata: {") and json.loads(event.split(b"data: ")[1]) == body


def test_the_cache_read_becomes_ps_and_the_prompt_total_is_kept() -> None:
    answer = b'{"usage": {"input_tokens": 2, "output_tokens": 4, "cache_read_input_tokens": 8}, "x": "\\"usage\\""}'
    fixed = json.loads(messages.with_cached(answer, 3))
    assert fixed["usage"] == {"input_tokens": 7, "output_tokens": 4, "cache_read_input_tokens": 3}
    assert fixed["x"] == '"usage"'
    unknown = json.loads(messages.with_cached(answer, None))["usage"]
    assert unknown == {"input_tokens": 10, "output_tokens": 4}  # P said nothing: no cache read is claimed
    created = {"input_tokens": 1, "output_tokens": 0, "cache_read_input_tokens": 5, "cache_creation_input_tokens": 2}
    assert messages.fixed_usage(created, 4) == {**created, "input_tokens": 2, "cache_read_input_tokens": 4}
    assert messages.fixed_usage({"input_tokens": 3, "output_tokens": 1}, 2)["cache_read_input_tokens"] == 2


def prefill_anthropic(cached: int, mode: str = "push", in_params: bool = True) -> Handler:
    plain = prefill_ok(mode=mode)

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        params = json.loads((await plain(request, body)).content)["kv_transfer_params"]
        if in_params:
            params["remote_prefill_cached_tokens"] = cached
        use = {"input_tokens": 10 - cached, "output_tokens": 1, "cache_read_input_tokens": cached}
        answer = {"id": "msg-p", "type": "message", "content": [], "usage": use, "kv_transfer_params": params}
        return httpx.Response(200, json=answer)

    return handle


def decode_anthropic() -> Handler:
    """A decode that reads the KV it received as a cache read (or P's count, when its params carry it)."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        told = (body.get("kv_transfer_params") or {}).get("remote_prefill_cached_tokens")
        read = 10 if told is None else told
        use = {"input_tokens": 10 - read, "output_tokens": 2, "cache_read_input_tokens": read}
        if not body.get("stream"):
            content = [{"type": "text", "text": "xy"}]
            return httpx.Response(200, json={"id": "msg-d", "type": "message", "content": content, "usage": use})
        start = {  # vLLM's message_start states no cache read
            "type": "message_start",
            "message": {"id": "msg-d", "content": [], "usage": {"input_tokens": 10, "output_tokens": 0}},
        }
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "xy"}}
        end = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": use}

        async def events() -> AsyncIterator[bytes]:
            yield f"event: message_start\ndata: {json.dumps(start)}\n\n".encode()
            yield f"event: content_block_delta\ndata: {json.dumps(delta)}\n\nevent: message_delta\n".encode()
            yield f"data: {json.dumps(end)}\n\nevent: message_stop\ndata: {{}}\n\n".encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle


async def usages(answer: StreamAnswer | JsonAnswer) -> list[dict[str, Any]]:
    if isinstance(answer, JsonAnswer):
        return [json.loads(answer.content)["usage"]]
    found = []
    for event in b"".join(await relay(answer)).split(b"\n\n"):
        payload = json.loads(event.split(b"data: ", 1)[1]) if b"data: " in event else {}
        use = payload.get("usage") or payload.get("message", {}).get("usage")
        if use:
            found.append(use)
    return found


@pytest.mark.parametrize("body", [BODY, STREAM], ids=["json", "stream"])
@pytest.mark.parametrize(("mode", "in_params"), [("push", True), ("push", False), ("pull", True), ("pull", False)])
async def test_messages_go_through_both_legs_and_bill_ps_cache_read(
    body: dict[str, Any], mode: str, in_params: bool
) -> None:
    workers = FakeWorkers({"p0": prefill_anthropic(3, mode, in_params), "d0": decode_anthropic()})
    dispatcher, _, timings = await make(workers, mode=mode)
    got = await usages(await dispatcher.handle(call_of(dispatcher, body, Endpoint.MESSAGES)))
    assert got and all(u["cache_read_input_tokens"] == 3 and u["input_tokens"] == 7 for u in got)
    (p_leg,), (d_leg,) = workers.legs("p0"), workers.legs("d0")
    assert p_leg.path == d_leg.path == "/v1/messages"
    assert p_leg.body["max_tokens"] == 1 and d_leg.body["max_tokens"] == 5
    assert p_leg.body["stream"] is False and d_leg.body.get("stream", False) is body.get("stream", False)
    (record,) = timings.query()
    assert record["outcome"] == "ok" and record["mode"] == mode


@pytest.fixture
async def router() -> AsyncIterator[tuple[httpx.AsyncClient, FakeWorkers]]:
    workers = FakeWorkers({"p0": prefill_anthropic(0), "d0": decode_anthropic()})
    settings = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200"]}
    app = create_app(build_settings(settings), transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as c:
        yield c, workers


async def test_a_bad_messages_request_gets_anthropics_400_before_any_worker(
    router: tuple[httpx.AsyncClient, FakeWorkers],
) -> None:
    c, workers = router
    response = await c.post("/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"] and workers.seen == []
    assert (await c.post("/v1/messages", content=b"{nope")).json()["type"] == "error"


async def test_a_decodes_4xx_reaches_the_client_in_anthropics_shape(
    router: tuple[httpx.AsyncClient, FakeWorkers],
) -> None:
    c, workers = router
    workers.handlers["d0"] = status(400, "thinking.budget_tokens must be less than max_tokens")
    response = await c.post("/v1/messages", json=BODY)
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "thinking.budget_tokens must be less than max_tokens"},
    }


async def test_a_messages_answer_is_served_through_the_router(router: tuple[httpx.AsyncClient, FakeWorkers]) -> None:
    c, workers = router
    response = await c.post("/v1/messages", json=BODY)
    assert response.status_code == 200 and response.json()["content"] == [{"type": "text", "text": "xy"}]
    assert response.json()["usage"] == {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 0}
    assert {s.worker for s in workers.seen} == {"p0", "d0"}


def test_the_record_reads_anthropics_usage_as_openais() -> None:
    answer = {"usage": {"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 3}}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 0}}}
    assert messages.openai_usage(answer) == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert messages.openai_usage(start) == {"prompt_tokens": 10, "completion_tokens": 0, "prompt_tokens_details": None}
    assert messages.openai_usage({"type": "ping"}) is None


@pytest.mark.parametrize("body", [BODY, STREAM], ids=["json", "stream"])
async def test_a_traced_message_ends_its_span_with_ps_counts(body: dict[str, Any]) -> None:
    tracing, exporter = in_memory()
    workers = FakeWorkers({"p0": prefill_anthropic(3), "d0": decode_anthropic()})
    dispatcher, _, _ = await make(workers)
    info = parse_request(Endpoint.MESSAGES, body)
    trace = tracing.start(w3c.read([]), "chat tiny", {})
    call = ClientRequest(body=body, info=info, record=dispatcher.new_record("client-1", info), trace=trace)
    answer = await dispatcher.handle(call)
    if isinstance(answer, StreamAnswer):
        await relay(answer)
    (server,) = [span for span in exporter.get_finished_spans() if span.name == "chat tiny"]
    assert server.attributes is not None
    assert server.attributes["gen_ai.usage.input_tokens"] == 10
    assert server.attributes["gen_ai.usage.cache_read.input_tokens"] == 3
