"""The dispatcher on request shapes that are not a plain one-choice prompt: what goes to which worker."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.answer import JsonAnswer, StreamAnswer
from router.domain import Endpoint
from tests.unit.router.fake_workers import FakeWorkers, Handler, decode_ok, prefill_ok
from tests.unit.router.test_dispatch import call_of, make, relay

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.COMPLETIONS, {**PROMPT, "use_beam_search": True}),
        (Endpoint.CHAT, {**CHAT, "use_beam_search": True}),
        (Endpoint.COMPLETIONS, {**PROMPT, "prompt_logprobs": 1}),
        (Endpoint.COMPLETIONS, {**PROMPT, "echo": True, "logprobs": 1}),
        (Endpoint.CHAT, {**CHAT, "echo": True, "top_logprobs": 1}),
    ],
)
async def test_a_request_vllm_computes_on_decode_anyway_goes_to_decode_alone(
    mode: str, endpoint: Endpoint, body: dict[str, Any]
) -> None:
    workers = FakeWorkers({"p0": prefill_ok(mode=mode), "d0": decode_ok()})
    dispatcher, _, timings = await make(workers, mode=mode)
    await relay(await dispatcher.handle(call_of(dispatcher, body, endpoint)))
    assert workers.legs("p0") == []
    (leg,) = workers.legs("d0")
    assert "kv_transfer_params" not in leg.body and leg.body == body
    (record,) = timings.query()
    assert record["mode"] == "bypass" and record["outcome"] == "ok"


def prefill_with_hit(cached: int | None, mode: str = "push", in_params: bool = True) -> Handler:
    """A prefill that found `cached` prompt tokens in its prefix cache and says so in its params or its usage."""
    plain = prefill_ok(mode=mode)

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        answer = json.loads((await plain(request, body)).content)
        if cached is not None and in_params:
            answer["kv_transfer_params"]["remote_prefill_cached_tokens"] = cached
        details = {"cached_tokens": cached} if cached is not None and not in_params else None
        answer["usage"] = {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": details}
        return httpx.Response(200, json=answer)

    return handle


def decode_with_usage(cached: int = 10) -> Handler:
    """A decode that counts the KV it received as cached (what vLLM does when it is not told P's count)."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        told = (body.get("kv_transfer_params") or {}).get("remote_prefill_cached_tokens")
        use = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": told or cached}}
        if not body.get("stream"):
            return httpx.Response(200, json={"id": "cmpl-d", "choices": [{"text": "xy"}], "usage": use})

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[{"text":"y"}]}\n\ndata: {"choices":[],'
            yield f'"usage":{json.dumps(use)}}}\n\ndata: [DONE]\n\n'.encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle


async def answered_usage(answer: StreamAnswer | JsonAnswer) -> dict[str, Any] | None:
    if isinstance(answer, JsonAnswer):
        found: dict[str, Any] | None = json.loads(answer.content).get("usage")
        return found
    events = b"".join(await relay(answer)).split(b"\n\n")
    payloads = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    usages = [p["usage"] for p in payloads if "usage" in p]
    return usages[-1] if usages else None


USAGE_STREAM = {**PROMPT, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("body", [{**PROMPT, "stream": False}, USAGE_STREAM], ids=["json", "stream"])
@pytest.mark.parametrize("in_params", [True, False], ids=["params", "usage"])
async def test_push_reports_ps_cache_hit_not_the_kv_decode_received(body: dict[str, Any], in_params: bool) -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(3, in_params=in_params), "d0": decode_with_usage()})
    dispatcher, _, timings = await make(workers)
    got = await answered_usage(await dispatcher.handle(call_of(dispatcher, body)))
    assert got is not None and got["prompt_tokens_details"] == {"cached_tokens": 3}
    assert got["prompt_tokens"] == 10 and got["completion_tokens"] == 2
    assert timings.query()[0]["outcome"] == "ok"


@pytest.mark.parametrize("body", [{**PROMPT, "stream": False}, USAGE_STREAM], ids=["json", "stream"])
async def test_when_p_states_no_count_the_details_are_null(body: dict[str, Any]) -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(None), "d0": decode_with_usage()})
    dispatcher, _, _ = await make(workers)
    got = await answered_usage(await dispatcher.handle(call_of(dispatcher, body)))
    assert got is not None and got["prompt_tokens_details"] is None and got["prompt_tokens"] == 10


@pytest.mark.parametrize("in_params", [True, False], ids=["params", "usage"])
async def test_pull_reports_ps_count_relayed_by_decode_or_rewritten(in_params: bool) -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(5, "pull", in_params), "d0": decode_with_usage()})
    dispatcher, _, _ = await make(workers, mode="pull")
    got = await answered_usage(await dispatcher.handle(call_of(dispatcher, USAGE_STREAM)))
    assert got is not None and got["prompt_tokens_details"] == {"cached_tokens": 5}


async def test_a_bypass_keeps_decodes_own_count() -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(3), "d0": decode_with_usage(cached=6)})
    dispatcher, _, _ = await make(workers)
    got = await answered_usage(await dispatcher.handle(call_of(dispatcher, {**USAGE_STREAM, "prompt_logprobs": 1})))
    assert got is not None and got["prompt_tokens_details"] == {"cached_tokens": 6}
    assert workers.legs("p0") == []


async def test_a_stream_without_usage_is_relayed_as_it_came() -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(3), "d0": decode_with_usage()})
    dispatcher, _, _ = await make(workers)
    answer = await dispatcher.handle(call_of(dispatcher, PROMPT))
    events = b"".join(await relay(answer))
    assert b'"cached_tokens": 10' in events  # what decode sent: the client did not ask for usage


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    "body", [{**PROMPT, "n": 3, "stream": False}, {**USAGE_STREAM, "n": 3}], ids=["json", "stream"]
)
async def test_n_choices_move_the_prompt_once_then_ask_decode_alone(mode: str, body: dict[str, Any]) -> None:
    workers = FakeWorkers({"p0": prefill_with_hit(2, mode), "d0": decode_with_usage()})
    dispatcher, _, timings = await make(workers, mode=mode)
    got = await answered_usage(await dispatcher.handle(call_of(dispatcher, body)))
    (p_leg,) = workers.legs("p0")
    moved, asked = workers.legs("d0")
    assert p_leg.body["n"] == moved.body["n"] == 1 and p_leg.body["max_tokens"] == moved.body["max_tokens"] == 1
    assert moved.body["stream"] is False and moved.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert asked.body == body  # the client's request, as it came: no KV params, its n
    assert asked.headers["x-request-id"] == p_leg.headers["x-request-id"]
    assert got is not None and got["prompt_tokens_details"] == {"cached_tokens": 2}
    (record,) = timings.query()
    assert record["outcome"] == "ok" and record["mode"] == mode


async def test_n_choices_on_a_bypass_go_to_decode_once() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_with_usage()})
    dispatcher, _, _ = await make(workers)
    body = {**PROMPT, "n": 2, "use_beam_search": True}
    await relay(await dispatcher.handle(call_of(dispatcher, body)))
    assert workers.legs("p0") == [] and [leg.body for leg in workers.legs("d0")] == [body]
