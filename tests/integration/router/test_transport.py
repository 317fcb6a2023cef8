"""The seams against real servers (the httpx transport for probes, AiohttpTransport; the legs' client,
Http1Legs): errors map to httpx's, short reads drop the connection (the server sees the client leave), whole reads
keep it, legs have no read timeout of their own, and a leg given up mid-upload drops its connection."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from router.aiohttp_transport import AiohttpTransport
from router.legs.base import LegTransport
from router.legs.http1_pool import Http1Legs
from stack.procs import ManagedProcess, ProcessSpec, free_port
from tests.integration.router.hostile import sockets_to
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


def make_legs(connect_timeout: float = 5.0) -> LegTransport:
    return Http1Legs(max_connections=8, connect_timeout=connect_timeout)


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


async def test_legs_stream_whole_answers_and_are_seen_leaving(worker: str) -> None:
    legs = make_legs()
    try:
        body = json.dumps({"model": "tiny", "prompt": "x", "stream": True}).encode()
        response = await legs.post(f"{worker}/v1/completions", body, {"content-type": "application/json"})
        assert response.status == 200 and response.content_type.startswith("text/event-stream")
        chunks = response.chunks()
        assert (await anext(chunks)).startswith(b"data: ")
        await chunks.aclose()
        await response.aclose()  # cut short: the worker sees the client leave
        async with client() as c:
            deadline = time.monotonic() + 10
            while await running(worker, c) != 0:
                assert time.monotonic() < deadline, "the server never saw the leg leave"
        whole = json.dumps({"model": "tiny", "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
        for _ in range(3):  # read to its end: the connection goes back to the pool
            answer = await legs.post(f"{worker}/v1/completions", whole.encode(), {"content-type": "application/json"})
            assert json.loads(await answer.read())["kv_transfer_params"]["transfer_mode"] == "push"
        with pytest.raises(httpx.ConnectError):
            await legs.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {})
    finally:
        await legs.aclose()


async def test_legs_have_no_read_timeout_of_their_own(worker: str) -> None:
    """A leg's own deadline is the only one: a 5 s stream (50 events, 0.1 s apart) is read whole."""
    legs = make_legs(connect_timeout=0.5)
    try:
        body = json.dumps({"model": "tiny", "prompt": "x", "stream": True}).encode()
        response = await legs.post(f"{worker}/v1/completions", body, {"content-type": "application/json"})
        data = b"".join([chunk async for chunk in response.chunks()])
        await response.aclose()
        assert data.count(b"data: ") == 51  # 50 tokens and [DONE]
    finally:
        await legs.aclose()


async def test_a_leg_given_up_while_the_worker_never_reads_its_body_drops_the_connection() -> None:
    """A plain close waits for the write buffer to drain first: the socket (and the buffered body) would stay
    for as long as the worker does not read."""
    finished = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await finished.wait()
        writer.close()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    legs = make_legs()

    def ours() -> int:
        return sockets_to(os.getpid(), port)  # our side only: remote port == the server's

    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):  # the leg's deadline
                await legs.post(f"http://127.0.0.1:{port}/v1/completions", b"x" * (16 * 2**20), {})
        deadline = time.monotonic() + 5.0  # hang guard, not a speed assertion
        while ours() > 0:
            assert time.monotonic() < deadline, f"the leg's connection is still open ({ours()} socket)"
            await asyncio.sleep(0.05)
    finally:
        finished.set()
        await legs.aclose()
        server.close()


async def test_legs_read_whole_keep_one_connection_and_one_cut_short_is_not_reused(
    worker: str,
) -> None:
    """Sequential whole answers share one pooled connection; a stream closed before its end leaves the pool."""
    legs = make_legs()
    port = int(worker.rsplit(":", 1)[1])
    whole = json.dumps({"model": "tiny", "prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}).encode()
    try:
        for _ in range(4):
            answer = await legs.post(f"{worker}/v1/completions", whole, {"content-type": "application/json"})
            assert json.loads(await answer.read())["kv_transfer_params"]["transfer_mode"] == "push"
        assert sockets_to(os.getpid(), port) == 1
        body = json.dumps({"model": "tiny", "prompt": "x", "stream": True}).encode()
        response = await legs.post(f"{worker}/v1/completions", body, {"content-type": "application/json"})
        chunks = response.chunks()
        assert (await anext(chunks)).startswith(b"data: ")
        await chunks.aclose()
        await response.aclose()
        deadline = time.monotonic() + 5.0  # hang guard, not a speed assertion
        while sockets_to(os.getpid(), port) > 0:
            assert time.monotonic() < deadline, "the connection of a stream cut short stayed open"
            await asyncio.sleep(0.05)
        answer = await legs.post(f"{worker}/v1/completions", whole, {"content-type": "application/json"})
        assert json.loads(await answer.read())["kv_transfer_params"]["transfer_mode"] == "push"
        assert sockets_to(os.getpid(), port) == 1
    finally:
        await legs.aclose()
