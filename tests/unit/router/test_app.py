"""The HTTP surface through ASGI (no sockets): validation errors, readiness, models, metrics, headers."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import build_settings
from router.workers.pool import Pool
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, hang, prefill_ok

SETTINGS = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200"]}


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, FakeWorkers]]:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    app = create_app(build_settings(SETTINGS), transport=workers.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            yield c, workers


@pytest.mark.parametrize(
    ("path", "content", "message"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b'{"prompt": "x"}', "'model'"),
        ("/v1/chat/completions", b'{"model": "tiny"}', "'messages'"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', "max_tokens"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "best_of": 2}', "'best_of'"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user"}], "n": 0}', "'n'"),
    ],
)
async def test_invalid_requests_get_400_without_touching_a_worker(
    client: tuple[httpx.AsyncClient, FakeWorkers], path: str, content: bytes, message: str
) -> None:
    c, workers = client
    response = await c.post(path, content=content, headers={"x-request-id": "mine"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert response.headers["x-request-id"] == "mine"
    assert workers.seen == []


async def test_a_refused_field_is_named_in_the_errors_param(client: tuple[httpx.AsyncClient, FakeWorkers]) -> None:
    c, workers = client
    response = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "best_of": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
    assert workers.seen == []


async def test_n_null_is_served_as_one_choice(client: tuple[httpx.AsyncClient, FakeWorkers]) -> None:
    c, workers = client
    response = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": None, "best_of": None})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    assert {s.worker for s in workers.seen} == {"p0", "d0"}


async def test_a_completion_echoes_the_client_id_and_names_the_pairing(
    client: tuple[httpx.AsyncClient, FakeWorkers],
) -> None:
    c, workers = client
    response = await c.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={"x-request-id": "client-7"}
    )
    assert response.status_code == 200 and response.json()["choices"]
    assert response.headers["x-request-id"] == "client-7"
    assert {s.headers["x-request-id"] for s in workers.seen} == {response.headers["x-kvpush-pairing-id"]}
    timings = (await c.get("/debug/timings", params={"request_id": "client-7"})).json()["requests"]
    assert [t["pairing_id"] for t in timings] == [response.headers["x-kvpush-pairing-id"]]


async def test_ready_models_health_and_metrics(client: tuple[httpx.AsyncClient, FakeWorkers]) -> None:
    c, _ = client
    assert (await c.get("/health")).json() == {"status": "ok"}
    ready = await c.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert (await c.get("/v1/models")).json()["data"][0]["id"] == "tiny"
    await c.post("/v1/completions", content=b"[]")
    text = (await c.get("/metrics")).text
    assert 'kvpush_worker_healthy{role="decode",worker="http://d0:8200"} 1.0' in text
    assert 'kvpush_errors_total{kind="bad_request"} 1.0' in text


async def test_not_ready_when_a_pool_is_down() -> None:
    workers = FakeWorkers({"p0": prefill_ok()}, down={"d0"})
    app = create_app(build_settings(SETTINGS), transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as c:
        ready = await c.get("/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        failed = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert failed.status_code == 503
        assert "no healthy decode worker" in json.loads(failed.content)["error"]["message"]


async def test_a_dead_background_loop_turns_ready_to_503_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    async def ends_at_once(self: Pool, *args: object, **kwargs: object) -> None:
        return None  # a health loop that returns has died: ejected workers would never come back

    monkeypatch.setattr(Pool, "run_health", ends_at_once)
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    app = create_app(build_settings(SETTINGS), transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as c:
        for _ in range(100):  # hang guard: the supervisor sees the loop end within a few loop turns
            if (await c.get("/ready")).status_code == 503:
                break
            await asyncio.sleep(0.01)
        assert (await c.get("/ready")).status_code == 503
        assert 'kvpush_loop_errors_total{loop="health"} 1.0' in (await c.get("/metrics")).text


async def test_models_and_timings_need_the_key_when_keys_are_set() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    app = create_app(build_settings({**SETTINGS, "api_keys": ["k" * 16]}), transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://r") as c:
        for path in ("/v1/models", "/debug/timings"):
            assert (await c.get(path)).status_code == 401
            assert (await c.get(path, headers={"authorization": "Bearer " + "k" * 16})).status_code == 200


async def test_a_client_leaving_before_the_first_byte_closes_both_legs_and_frees_everything() -> None:
    closed = asyncio.Event()
    workers = FakeWorkers({"p0": hang(closed), "d0": hang()})
    app = create_app(build_settings(SETTINGS), transport=workers.transport())
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(0.05)  # the legs are in flight by now
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    async with app.router.lifespan_context(app):
        async with asyncio.timeout(10):  # hang guard
            await app(scope, receive, send)
        service = app.state.service
        assert sent == [] and closed.is_set()
        assert service.admission.in_flight == 0
        assert all(w["in_flight"] == 0 for w in service.pool.snapshot())
        assert service.timings.query()[0]["outcome"] == "client_gone"


async def test_the_served_router_freezes_its_start_up_heap_once_started_and_tests_by_default_do_not() -> None:
    gc.unfreeze()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    plain = create_app(build_settings(SETTINGS), transport=workers.transport())
    async with plain.router.lifespan_context(plain):
        assert gc.get_freeze_count() == 0
    served = create_app(build_settings(SETTINGS), transport=workers.transport(), freeze_heap=True)
    assert gc.get_freeze_count() == 0  # not before the service has started
    try:
        async with served.router.lifespan_context(served):
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
