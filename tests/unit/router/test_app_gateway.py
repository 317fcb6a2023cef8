"""The sidecar behind a Gateway API InferencePool, through the HTTP app: the EPP's `x-prefiller-host-port` picks
the prefill (a pool member: both legs leave at once), anything else is a 400 before any worker is dialled, and a
missing header is a 400 only when the setting requires it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import build_settings
from router.gateway import PREFILLER_HEADER
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, prefill_ok

PREFILLS = ["http://p0:8100,engine_id=p0,side_port=5600", "http://p1:8100,engine_id=p1,side_port=5600"]
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


async def serving(workers: FakeWorkers, prefill_header: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = build_settings(
        {"prefill": PREFILLS, "decode": ["http://d0:8200"], "gateway": {"prefill_header": prefill_header}}
    )
    app = create_app(settings, transport=workers.transport())
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


@pytest.fixture
async def required() -> AsyncIterator[tuple[httpx.AsyncClient, FakeWorkers, asyncio.Event]]:
    gate = asyncio.Event()
    workers = FakeWorkers(
        {"p0": prefill_ok("p0"), "p1": prefill_ok("p1", gate=gate), "d0": decode_ok(on_request=gate.set)}
    )
    async for c in serving(workers, "required"):
        yield c, workers, gate


async def test_the_named_prefill_serves_and_both_legs_leave_at_once(
    required: tuple[httpx.AsyncClient, FakeWorkers, asyncio.Event],
) -> None:
    c, workers, _ = required
    for _ in range(3):
        response = await c.post("/v1/completions", json=BODY, headers={PREFILLER_HEADER: "p1:8100"})
        assert response.status_code == 200
    # p1 answers only once decode was sent (the gate): the legs overlapped; p0 never served
    assert len(workers.legs("p1")) == 3 and workers.legs("p0") == []
    assert {d.body["kv_transfer_params"]["remote_engine_id"] for d in workers.legs("d0")} == {"p1"}


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({PREFILLER_HEADER: "evil:8100"}, "not in this router's prefill pool"),
        ({PREFILLER_HEADER: "p1:8101"}, "not in this router's prefill pool"),
        ({PREFILLER_HEADER: "p1"}, "host:port"),
        ({}, "missing"),
    ],
)
async def test_anything_else_is_a_400_and_no_worker_is_dialled(
    required: tuple[httpx.AsyncClient, FakeWorkers, asyncio.Event], headers: dict[str, str], message: str
) -> None:
    c, workers, _ = required
    response = await c.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == 400
    error: dict[str, Any] = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert workers.seen == []


async def test_optional_lets_the_router_pick_without_the_header() -> None:
    workers = FakeWorkers({"p0": prefill_ok("p0"), "p1": prefill_ok("p1"), "d0": decode_ok()})
    async for c in serving(workers, "optional"):
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert (await c.post("/v1/completions", json=BODY, headers={PREFILLER_HEADER: "nope:1"})).status_code == 400
    assert len(workers.legs("p0")) + len(workers.legs("p1")) == 1


async def test_off_ignores_the_header() -> None:
    workers = FakeWorkers({"p0": prefill_ok("p0"), "p1": prefill_ok("p1"), "d0": decode_ok()})
    async for c in serving(workers, "off"):
        response = await c.post("/v1/completions", json=BODY, headers={PREFILLER_HEADER: "evil:1"})
        assert response.status_code == 200
