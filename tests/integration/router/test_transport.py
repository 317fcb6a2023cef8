"""The aiohttp-backed httpx transport against a real server: errors map to httpx's, short reads drop the
connection (the server sees the client leave), whole reads keep it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from router.transport import AiohttpTransport
from stack.procs import ManagedProcess, ProcessSpec, free_port
from tests.integration.vllm_support import LOGS, REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    port = free_port()
    argv = (
        sys.executable,
        "-m",
        "tests.integration.router.fake_worker",
        "--port",
        str(port),
        "--tokens",
        "50",
        "--delay",
        "0.1",
    )
    proc = ManagedProcess(
        ProcessSpec(
            name=f"transport-{port}",
            argv=argv,
            env={},
            log_path=LOGS / "transport.log",
            ready_url=f"http://127.0.0.1:{port}/health",
            cwd=REPO,
        )
    )
    proc.start()
    proc.wait_healthy(30)
    yield f"http://127.0.0.1:{port}"
    proc.stop(5)


def client(read: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(max_connections=8), timeout=httpx.Timeout(5, read=read))


async def running(url: str, c: httpx.AsyncClient) -> float:
    text = (await c.get(f"{url}/metrics")).text
    return float(text.split("vllm:num_requests_running")[1].split()[1])


async def test_a_stream_cut_short_is_seen_by_the_server(worker: str) -> None:
    body = {"model": "tiny", "prompt": "x", "stream": True}
    async with client() as c:
        async with c.stream("POST", f"{worker}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                assert chunk.startswith(b"data: ")
                break
            assert await running(worker, c) == 1
        deadline = time.monotonic() + 10
        while await running(worker, c) != 0:
            assert time.monotonic() < deadline, "the server never saw the client leave"


async def test_whole_answers_and_json(worker: str) -> None:
    async with client() as c:
        for _ in range(3):
            answer = await c.post(
                f"{worker}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "x",
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            )
            assert answer.status_code == 200 and answer.json()["kv_transfer_params"]["transfer_mode"] == "push"
        assert (await c.get(f"{worker}/v1/models")).json()["data"][0]["id"] == "tiny"


async def test_errors_are_httpx_errors(worker: str) -> None:
    async with client() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{free_port()}/health")
    async with client(read=0.05) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(f"{worker}/v1/completions", json={"model": "tiny", "prompt": "x"})
