"""vLLM's helper endpoints through the router: one healthy worker answers, its answer relayed as it came."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import build_settings
from tests.unit.router.fake_workers import FakeWorkers, Handler, status

SETTINGS = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200"]}


def helper(name: str) -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0", "worker": name})
        return httpx.Response(200, json={"tokens": [1, 2], "path": request.url.path, "body": body, "worker": name})

    return handle


async def call(workers: FakeWorkers, method: str, path: str, **kwargs: Any) -> httpx.Response:
    app = create_app(build_settings(SETTINGS, {"limits": {"max_body_bytes": 1000}}), transport=workers.transport())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.request(method, path, **kwargs)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/messages/count_tokens"])
async def test_a_helper_call_goes_to_the_decode_worker_as_it_came(path: str) -> None:
    workers = FakeWorkers({"p0": helper("p0"), "d0": helper("d0")})
    response = await call(workers, "POST", path, json={"model": "tiny", "prompt": "hi"})
    assert response.status_code == 200
    assert response.json() == {
        "tokens": [1, 2],
        "path": path,
        "body": {"model": "tiny", "prompt": "hi"},
        "worker": "d0",
    }


async def test_version_and_a_failing_decode_passed_over_for_a_prefill() -> None:
    workers = FakeWorkers({"p0": helper("p0"), "d0": status(500)})
    response = await call(workers, "GET", "/version")
    assert response.status_code == 200 and response.json()["worker"] == "p0"


async def test_a_workers_4xx_is_the_clients_answer_and_nothing_left_is_503() -> None:
    workers = FakeWorkers({"p0": helper("p0"), "d0": status(400, "bad tokens")})
    response = await call(workers, "POST", "/detokenize", json={"tokens": ["x"]})
    assert response.status_code == 400 and "bad tokens" in response.text
    workers = FakeWorkers({"p0": status(503), "d0": status(502)})
    response = await call(workers, "POST", "/tokenize", json={})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


async def test_a_body_over_the_limit_reaches_no_worker() -> None:
    workers = FakeWorkers({"p0": helper("p0"), "d0": helper("d0")})
    response = await call(workers, "POST", "/tokenize", content=b"x" * 2000)
    assert response.status_code == 413 and workers.seen == []
