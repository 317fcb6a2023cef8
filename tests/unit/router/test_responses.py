"""OpenAI's Responses API through the router: refusals, owner ids, held first events, follow-ups to the owner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router import responses
from router.answer import JsonAnswer, StreamAnswer
from router.app import create_app
from router.config import build_settings
from router.dispatch import ClientRequest
from router.domain import Endpoint
from router.errors import BadRequest, UpstreamTimeout
from router.protocol import parse_request, prefill_body
from router.sse import error_of, payload_of
from router.tracing import context as w3c
from tests.unit.router.fake_workers import FakeWorkers, Handler, prefill_ok
from tests.unit.router.test_dispatch import call_of, make, relay
from tests.unit.router.tracing.support import in_memory

BODY = {"model": "tiny", "input": "hello there", "max_output_tokens": 5}
STREAM = {**BODY, "stream": True}
D0, D1 = "http://d0:8200", "http://d1:8200"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**BODY, "background": True}, "background"),
        ({**BODY, "tools": [{"type": "web_search_preview"}]}, "tools"),
        ({**BODY, "tools": [{"type": "function", "name": "f"}, {"type": "code_interpreter"}]}, "tools"),
        ({**BODY, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({**BODY, "input": [{"type": "image_generation_call"}]}, "input"),
        ({**BODY, "input": []}, "input"),
        ({**BODY, "request_id": "resp_mine"}, "request_id"),
        ({**BODY, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({**BODY, "max_output_tokens": 0}, "max_output_tokens"),
        ({**BODY, "previous_response_id": 7}, "previous_response_id"),
    ],
)
def test_what_pd_cannot_serve_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_request(Endpoint.RESPONSES, body)
    assert refused.value.param == param


def test_messages_and_client_tools_are_served() -> None:
    items = [
        {"role": "user", "content": "a" * 40},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b" * 40}]},
        {"type": "function_call_output", "call_id": "c", "output": "c" * 40},
    ]
    body = {**BODY, "input": items, "instructions": "d" * 40, "tools": [{"type": "function", "name": "f"}]}
    assert parse_request(Endpoint.RESPONSES, body).prompt_tokens == 40


def test_the_prefill_leg_is_one_token_and_stores_nothing() -> None:
    body = responses.owned({**STREAM, "store": True}, D0)
    out = prefill_body(body, Endpoint.RESPONSES, "xfer-1")
    assert out["max_output_tokens"] == 1 and out["stream"] is False and out["store"] is False
    assert out["background"] is False and "max_tokens" not in out
    assert out["request_id"] == body["request_id"]  # upstream push pairs the legs by it
    assert out["kv_transfer_params"]["do_remote_decode"] is True


def test_a_response_id_names_its_decode_among_the_pool_only() -> None:
    made = responses.response_id(D1)
    assert made.startswith("resp_") and responses.owner_of(made, [D0, D1]) == D1
    assert responses.owner_of(made, [D0]) is None  # its decode is not (or no longer) configured here
    assert responses.owner_of(responses.response_id("http://evil:1"), [D0, D1]) is None
    for forged in ("resp_abc", f"{made}x", made.upper(), "resp_0123456789abcdef_" + "0" * 31, ""):
        assert responses.owner_of(forged, [D0, D1]) is None
    assert responses.response_id(D0) != responses.response_id(D0)


def test_the_in_band_error_is_numbered_after_the_last_event() -> None:
    error = UpstreamTimeout("no event for 1 s", leg="decode", worker=D0)
    last = b'event: response.output_text.delta\ndata: {"sequence_number": 6, "delta": "x"}\n\n'
    event = responses.error_event(error, last)
    assert event.startswith(b"event: error\ndata: ")
    payload = payload_of(event)
    assert payload["type"] == "error" and payload["sequence_number"] == 7 and payload["code"] == "upstream_timeout"
    assert D0 not in payload["message"] and error_of(event) == payload["message"]


def test_usage_states_ps_cached_count() -> None:
    details = b'{"cached_tokens": 9, "cached_tokens_per_turn": [9], "input_tokens_per_turn": [12]}'
    answer = b'{"usage": {"input_tokens": 12, "input_tokens_details": ' + details + b"}}"
    fixed = json.loads(responses.with_cached(answer, 4))["usage"]["input_tokens_details"]
    assert fixed == {"cached_tokens": 4, "cached_tokens_per_turn": [4], "input_tokens_per_turn": [12]}
    assert json.loads(responses.with_cached(answer, None))["usage"]["input_tokens_details"]["cached_tokens"] is None


def held_events() -> list[bytes]:
    kinds = ("response.created", "response.in_progress")
    return [f'event: {k}\ndata: {{"type": "{k}", "sequence_number": {i}}}\n\n'.encode() for i, k in enumerate(kinds)]


def prefill_responses(cached: int, mode: str = "push") -> Handler:
    plain = prefill_ok(mode=mode)

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        params = json.loads((await plain(request, body)).content)["kv_transfer_params"]
        use = {"input_tokens": 10, "output_tokens": 1, "input_tokens_details": {"cached_tokens": cached}}
        return httpx.Response(200, json={"id": body["request_id"], "usage": use, "kv_transfer_params": params})

    return handle


def decode_responses(first: asyncio.Event | None = None, fail_first: bool = False) -> Handler:
    """Sends response.created and response.in_progress at once (as vLLM does), the rest once `first` is set; with
    `fail_first` the first real event is an error."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        told = (body.get("kv_transfer_params") or {}).get("remote_prefill_cached_tokens")
        use = {"input_tokens": 10, "output_tokens": 2, "input_tokens_details": {"cached_tokens": told or 10}}
        done = {"id": body["request_id"], "output": [{"type": "message"}], "usage": use}
        if not body.get("stream"):
            return httpx.Response(200, json=done)

        async def events() -> AsyncIterator[bytes]:
            for event in held_events():
                yield event
            if first is not None:
                await first.wait()
            if fail_first:
                yield b'event: error\ndata: {"type": "error", "message": "KV load failed", "sequence_number": 2}\n\n'
                return
            yield b'event: response.output_text.delta\ndata: {"type": "x", "delta": "xy", "sequence_number": 2}\n\n'
            completed = {"type": "response.completed", "response": done, "sequence_number": 3}
            yield f"event: response.completed\ndata: {json.dumps(completed)}\n\n".encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle


async def answered(answer: StreamAnswer | JsonAnswer) -> tuple[list[Any], dict[str, Any] | None]:
    if isinstance(answer, JsonAnswer):
        parsed = json.loads(answer.content)
        return [parsed], parsed["usage"]
    events = [payload_of(e + b"\n\n") for e in b"".join(await relay(answer)).split(b"\n\n") if e]
    return events, responses.usage_of(events[-1])


@pytest.mark.parametrize("body", [BODY, STREAM], ids=["json", "stream"])
@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_first_turn_is_a_pair_whose_id_names_the_decode(body: dict[str, Any], mode: str) -> None:
    workers = FakeWorkers({"p0": prefill_responses(3, mode), "d0": decode_responses()})
    dispatcher, _, timings = await make(workers, mode=mode)
    events, use = await answered(await dispatcher.handle(call_of(dispatcher, body, Endpoint.RESPONSES)))
    (p_leg,), (d_leg,) = workers.legs("p0"), workers.legs("d0")
    assert p_leg.path == d_leg.path == "/v1/responses" and p_leg.body["store"] is False
    assert p_leg.body["request_id"] == d_leg.body["request_id"]
    assert responses.owner_of(d_leg.body["request_id"], [D0]) == D0
    assert use is not None and use["input_tokens_details"]["cached_tokens"] == 3
    if body.get("stream"):
        assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]  # relayed 1:1
    assert timings.query()[0]["outcome"] == "ok"


async def test_the_first_byte_deadline_waits_past_the_held_events() -> None:
    workers = FakeWorkers({"p0": prefill_responses(0), "d0": decode_responses(first=asyncio.Event())})
    dispatcher, _, _ = await make(workers, timeouts={"decode_first_byte": 0.2}, retries=0)
    with pytest.raises(UpstreamTimeout):  # response.created alone is no sign that the KV came
        await dispatcher.handle(call_of(dispatcher, STREAM, Endpoint.RESPONSES))


async def test_an_error_after_the_held_events_is_retried_with_a_fresh_id() -> None:
    workers = FakeWorkers(
        {"p0": prefill_responses(0), "d0": decode_responses(fail_first=True), "d1": decode_responses()}
    )
    dispatcher, _, timings = await make(workers, decode=[D0, D1], decode_policy="round-robin")
    events, _ = await answered(await dispatcher.handle(call_of(dispatcher, STREAM, Endpoint.RESPONSES)))
    (failed,), (served,) = workers.legs("d0"), workers.legs("d1")
    assert responses.owner_of(failed.body["request_id"], [D0, D1]) == D0
    assert responses.owner_of(served.body["request_id"], [D0, D1]) == D1  # the id names the decode that answered
    assert [e["type"] for e in events][-1] == "response.completed" and timings.query()[0]["attempts"] == 2


@pytest.fixture
async def router() -> AsyncIterator[tuple[httpx.AsyncClient, FakeWorkers]]:
    workers = FakeWorkers({"p0": prefill_responses(0), "d0": decode_responses(), "d1": decode_responses()})
    settings = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": [D0, D1]}
    app = create_app(build_settings(settings), transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as c:
        yield c, workers


async def test_a_follow_up_stored_get_and_cancel_reach_the_owner_alone(
    router: tuple[httpx.AsyncClient, FakeWorkers],
) -> None:
    c, workers = router
    first = (await c.post("/v1/responses", json=BODY)).json()
    owner = responses.owner_of(first["id"], [D0, D1])
    assert owner is not None
    host = owner.split("//")[1].split(":")[0]
    workers.seen.clear()
    for _ in range(3):
        follow = await c.post("/v1/responses", json={**BODY, "previous_response_id": first["id"]})
        assert follow.status_code == 200 and responses.owner_of(follow.json()["id"], [D0, D1]) == owner
    assert {s.worker for s in workers.seen} == {host}  # a bypass to the owner: no prefill leg
    assert all(s.body["previous_response_id"] == first["id"] for s in workers.seen)
    workers.seen.clear()
    workers.handlers[host] = stored_answers()
    got = await c.get(f"/v1/responses/{first['id']}")
    cancelled = await c.post(f"/v1/responses/{first['id']}/cancel")
    assert got.status_code == 200 and got.json() == {"id": first["id"], "path": f"/v1/responses/{first['id']}"}
    assert cancelled.status_code == 200 and cancelled.json()["path"].endswith("/cancel")
    assert [s.worker for s in workers.seen] == [host, host]


def stored_answers() -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"id": request.url.path.split("/")[3], "path": request.url.path})

    return handle


@pytest.mark.parametrize("forged", ["resp_0123456789abcdef_" + "0" * 32, "resp_123", "../../admin"])
async def test_a_forged_or_foreign_id_is_404_and_dials_nobody(
    router: tuple[httpx.AsyncClient, FakeWorkers], forged: str
) -> None:
    c, workers = router
    follow = await c.post("/v1/responses", json={**BODY, "previous_response_id": forged})
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    assert (await c.get(f"/v1/responses/{forged}")).status_code == 404
    assert (await c.post(f"/v1/responses/{forged}/cancel")).status_code == 404
    assert workers.seen == []


async def test_background_is_refused_before_any_worker(router: tuple[httpx.AsyncClient, FakeWorkers]) -> None:
    c, workers = router
    response = await c.post("/v1/responses", json={**BODY, "background": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "background"
    assert workers.seen == []


def test_the_record_reads_the_responses_usage_as_openais() -> None:
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 9, "output_tokens": 4}}}
    assert responses.openai_usage(completed) == {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
    }
    details = {"input_tokens": 9, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 2}}
    assert (responses.openai_usage({"usage": details}) or {})["prompt_tokens_details"] == {"cached_tokens": 2}
    assert responses.openai_usage({"type": "response.created", "response": {"usage": None}}) is None


async def test_a_traced_stream_ends_its_span_with_ps_count() -> None:
    tracing, exporter = in_memory()
    workers = FakeWorkers({"p0": prefill_responses(3), "d0": decode_responses()})
    dispatcher, _, _ = await make(workers)
    info = parse_request(Endpoint.RESPONSES, STREAM)
    trace = tracing.start(w3c.read([]), "responses tiny", {})
    call = ClientRequest(body=STREAM, info=info, record=dispatcher.new_record("client-1", info), trace=trace)
    await relay(await dispatcher.handle(call))
    (server,) = [span for span in exporter.get_finished_spans() if span.name == "responses tiny"]
    assert server.attributes is not None
    assert server.attributes["gen_ai.usage.input_tokens"] == 10
    assert server.attributes["gen_ai.usage.output_tokens"] == 2
    assert server.attributes["gen_ai.usage.cache_read.input_tokens"] == 3
