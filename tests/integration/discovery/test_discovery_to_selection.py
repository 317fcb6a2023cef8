"""Discovery, load scraping and load-aware selection together over loopback: dnsmasq names fake vLLM workers,
the router's Pool takes the membership, the Scraper reads each worker's /metrics, LoadAware picks."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest
import uvicorn

from router.discovery.dns import DnspythonResolver, DnsSource
from router.domain import Endpoint, RequestInfo, Role
from router.metrics import Metrics
from router.policy import LoadAware
from router.workers.pool import Pool
from router.workers.scrape import Scraper
from tests.integration.discovery.dnsmasq import DOMAIN, Dnsmasq
from tests.integration.discovery.recording import until

pytestmark = pytest.mark.integration

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
REQ = RequestInfo(endpoint=Endpoint.COMPLETIONS, stream=True, prompt_tokens=10)


class FakeEngine:
    """Answers /health, and /metrics with vLLM's load gauges (or never, when `hang`)."""

    def __init__(self) -> None:
        self.running, self.waiting, self.kv, self.hang = 0, 0, 0.0, False

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/metrics" and self.hang:
            await asyncio.Event().wait()
        body = (
            f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
            f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv}\n'
        ).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body if scope["path"] == "/metrics" else b""})


def _sockets() -> list[socket.socket]:
    """One listening socket per host, all on the same port (the DNS source gives one port for all)."""
    for _ in range(50):
        first = socket.create_server((HOSTS[0], 0))
        port, socks = first.getsockname()[1], [first]
        try:
            socks += [socket.create_server((host, port)) for host in HOSTS[1:]]
            return socks
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no port free on every loopback host")


@pytest.fixture
async def engines() -> AsyncIterator[tuple[int, dict[str, FakeEngine]]]:
    socks = _sockets()
    fakes = {host: FakeEngine() for host in HOSTS}
    servers = [
        uvicorn.Server(uvicorn.Config(fakes[host], lifespan="off", log_level="warning", timeout_graceful_shutdown=1))
        for host in HOSTS
    ]
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, sock in zip(servers, socks, strict=True)]
    await until(lambda: all(s.started for s in servers), "the fake engines to listen")
    try:
        yield socks[0].getsockname()[1], fakes
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)


async def test_discovered_workers_are_scraped_and_the_least_loaded_is_picked(
    dnsmasq: Dnsmasq, engines: tuple[int, dict[str, FakeEngine]]
) -> None:
    port, fakes = engines
    dnsmasq.set_records({"decode": list(HOSTS)})
    pool = Pool([], Metrics())
    source = DnsSource(
        Role.DECODE,
        f"decode.{DOMAIN}",
        port,
        interval=0.1,
        timeout=1.0,
        resolver=DnspythonResolver("127.0.0.1", dnsmasq.port, timeout=1.0),
    )
    url = {host: f"http://{host}:{port}" for host in HOSTS}
    fakes[HOSTS[0]].waiting, fakes[HOSTS[1]].running = 3, 2  # host 0 queues, host 1 is merely busy
    fakes[HOSTS[2]].hang = True  # its /metrics never answers: its load stays unknown
    policy = LoadAware()
    task = asyncio.create_task(source.run(pool))
    try:
        async with httpx.AsyncClient() as client:
            scraper = Scraper(client, pool.all_members, pool, interval=1.0, timeout=0.5)
            await until(lambda: len(pool.members(Role.DECODE)) == 3, "three discovered workers")
            await pool.probe_all(client, timeout=2.0)
            await scraper.scrape_once()
            views = {v.id: v for v in pool.candidates(Role.DECODE)}
            assert (views[url[HOSTS[0]]].engine_waiting, views[url[HOSTS[1]]].engine_running) == (3, 2)
            assert not views[url[HOSTS[2]]].load_known
            with pool.track(url[HOSTS[2]], 10), pool.track(url[HOSTS[2]], 10), pool.track(url[HOSTS[2]], 10):
                assert policy.select(pool.candidates(Role.DECODE), REQ).id == url[HOSTS[1]]

            fakes[HOSTS[0]].waiting, fakes[HOSTS[1]].waiting = 0, 5  # the queue moves
            dnsmasq.set_records({"decode": list(HOSTS[:2])})  # and host 2 leaves the service
            await until(lambda: len(pool.members(Role.DECODE)) == 2, "host 2 to leave")
            await scraper.scrape_once()
            assert policy.select(pool.candidates(Role.DECODE), REQ).id == url[HOSTS[0]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
