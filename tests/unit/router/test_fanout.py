"""A batched completions request through the app: one pair per prompt, merged answers, failures close the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.app import create_app
from router.config import build_settings
from tests.unit.router.fake_workers import FakeWorkers, Handler, hang, prefill_ok, status

SETTINGS = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200"]}


def echoing_decode() -> Handler:
    """A decode that answers with its prompt, once per choice, and usage."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        prompt, n = body["prompt"], body.get("n") or 1
        usage = {"prompt_tokens": 5, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
        choices = [{"index": k, "text": f"{prompt}/{k}"} for k in range(n)]
        if not body.get("stream"):
            return httpx.Response(200, json={"id": f"cmpl-{prompt}", "choices": choices, "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            for choice in choices:
                yield f"data: {json.dumps({'id': prompt, 'choices': [choice]})}\n\n".encode()
            yield f"data: {json.dumps({'id': prompt, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return handle


async def post(
    workers: FakeWorkers, body: dict[str, Any], overrides: dict[str, Any] | None = None, **limits: int
) -> httpx.Response:
    settings = build_settings(SETTINGS, {**({"limits": limits} if limits else {}), **(overrides or {})})
    app = create_app(settings, transport=workers.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions", json=body)


BODY = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2, "temperature": 1.0}


async def test_a_json_batch_is_one_pair_per_prompt_merged_with_vllms_indices() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": echoing_decode()})
    response = await post(workers, {**BODY, "n": 1})
    assert response.status_code == 200
    got = response.json()
    assert [(c["index"], c["text"]) for c in got["choices"]] == [(0, "a/0"), (1, "b/0"), (2, "c/0")]
    assert got["usage"]["prompt_tokens"] == 15 and got["usage"]["completion_tokens"] == 3
    prefills = workers.legs("p0")
    assert sorted(leg.body["prompt"] for leg in prefills) == ["a", "b", "c"]
    transfers = {leg.body["kv_transfer_params"]["transfer_id"] for leg in prefills}
    assert len(transfers) == 3  # each prompt its own pairing
    assert response.headers["x-kvpush-pairing-id"].count(",") == 2


async def test_a_streamed_batch_is_merged_with_one_usage_event_and_one_done() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": echoing_decode()})
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    response = await post(workers, body)
    events = [e for e in response.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    texts = {c["index"]: c["text"] for p in payloads for c in p["choices"]}
    assert texts == {0: "a/0", 1: "a/1", 2: "b/0", 3: "b/1", 4: "c/0", 5: "c/1"}
    assert len({p["id"] for p in payloads}) == 1
    usages = [p["usage"] for p in payloads if "usage" in p]
    assert usages == [{"prompt_tokens": 15, "completion_tokens": 6, "prompt_tokens_details": None}]  # P said none


async def test_a_batch_over_the_limit_reaches_no_worker() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": echoing_decode()})
    response = await post(workers, BODY, max_batch_prompts=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert workers.seen == []


async def test_a_failing_prompt_fails_the_batch_and_closes_the_other_legs() -> None:
    closed = asyncio.Event()
    hung = hang(closed)
    decode = echoing_decode()

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body["prompt"] == "b":
            return await status(400, "bad prompt")(request, body)
        if body["prompt"] == "c":
            return await hung(request, body)
        return await decode(request, body)

    workers = FakeWorkers({"p0": prefill_ok(), "d0": handle})
    response = await post(workers, {**BODY, "n": 1})
    assert response.status_code == 400 and "bad prompt" in response.json()["error"]["message"]
    assert closed.is_set()


async def test_a_batch_holds_a_slot_per_prompt() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": echoing_decode()})
    response = await post(workers, BODY, {"max_in_flight": 2, "admission_queue": 0})
    assert response.status_code == 429 and workers.seen == []
    response = await post(workers, {**BODY, "prompt": ["a", "b"]}, {"max_in_flight": 2, "admission_queue": 0})
    assert response.status_code == 200 and len(response.json()["choices"]) == 4
