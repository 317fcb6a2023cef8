"""Operating the router (real router process, stand-in workers): drain, admission, health, auth, fallback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from stack.engines import prefill_arg
from stack.procs import ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, router_spec
from tests.integration.router.hostile import rss_kib
from tests.integration.support import LOGS, REPO, wait_for

pytestmark = pytest.mark.integration
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}


@dataclass
class Proc:
    handle: ManagedProcess
    url: str
    port: int


def start(name: str, argv: list[str], port: int, ready: str, env: dict[str, str] | None = None) -> Proc:
    handle = ManagedProcess(
        ProcessSpec(
            name=name,
            argv=tuple(argv),
            env={**os.environ, **(env or {})},
            log_path=LOGS / f"{name}.log",
            ready_url=f"http://127.0.0.1:{port}{ready}",
            cwd=REPO,
        )
    )
    handle.start()
    handle.wait_healthy(30.0)
    return Proc(handle, f"http://127.0.0.1:{port}", port)


def fake(name: str, port: int = 0, tokens: int = 20, delay: float = 0.05) -> Proc:
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "tests.integration.router.fake_worker",
        "--port",
        str(port),
        "--engine-id",
        name,
        "--tokens",
        str(tokens),
        "--delay",
        str(delay),
    ]
    return start(f"fake-{name}-{port}", argv, port, "/health")


def router(
    prefills: list[Proc], decodes: list[Proc], *flags: str, env: dict[str, str] | None = None, ready: str = "/health"
) -> Proc:
    port = free_port()
    spec = router_spec(
        port,
        None,
        [prefill_arg(p.url, "fake", 5600) for p in prefills],
        [d.url for d in decodes],
        "--health-interval",
        "0.3",
        *flags,
        name=f"router-ops-{port}",
        ready_path=ready,
        env=env,
    )
    handle = Router(spec, log_dir=LOGS)
    handle.start()
    handle.wait_healthy(30.0)
    return Proc(handle, handle.url, handle.port)


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.handle.stop(5.0)


def stream(
    url: str,
    body: dict[str, object] = BODY,
    started: threading.Event | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, list[str]]:
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response,
    ):
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
        return response.status_code, events


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready", timeout=5)


def sigterm_during_streams(
    pool: ThreadPoolExecutor, r: Proc, n: int, tokens: int
) -> list[Future[tuple[int, list[str]]]]:
    """Starts `n` streams of `tokens` tokens, SIGTERMs the router once all have begun, waits for /ready to go 503."""
    first = [threading.Event() for _ in range(n)]
    streams = [pool.submit(stream, r.url, {**BODY, "max_tokens": tokens}, ev) for ev in first]
    for ev in first:
        assert ev.wait(20), "every stream started"
    assert r.handle.pid is not None
    os.kill(r.handle.pid, signal.SIGTERM)
    wait_for(lambda: ready(r.url).status_code == 503, "/ready goes 503 while draining")
    return streams


def test_sigterm_lets_eight_streams_finish_and_exits_zero() -> None:
    p, d = fake("p"), fake("d", tokens=40, delay=0.05)
    r = router([p], [d], "--drain-delay", "1", "--drain-grace", "20")
    with running(p, d, r), ThreadPoolExecutor(8) as pool:
        streams = sigterm_during_streams(pool, r, 8, 40)
        results = [s.result() for s in streams]
        assert all(status == 200 and events[-1] == "[DONE]" and len(events) == 41 for status, events in results)
        assert r.handle.stop(30.0) == 0


def test_stop_signals_that_keep_coming_while_the_router_exits_still_end_it_with_zero() -> None:
    """A supervisor may signal again while the drained router is on its way out (the stack's stop does): from the
    first signal to the exit, no signal may find the default disposition and kill the process."""
    p, d = fake("p"), fake("d")
    r = router([p], [d], "--drain-delay", "0", "--drain-grace", "1")
    with running(p, d, r):
        pid = r.handle.pid
        assert pid is not None

        def signalled_and_gone() -> bool:
            with contextlib.suppress(ProcessLookupError):  # reaped between the poll and the kill
                os.kill(pid, signal.SIGTERM)
            return r.handle.exit_code() is not None

        wait_for(signalled_and_gone, "the router exits while SIGTERM arrives every 2 ms", interval=0.002)
        assert r.handle.exit_code() == 0


def test_a_burst_above_the_bound_gets_429s_not_timeouts_and_memory_stays_bounded() -> None:
    p, d = fake("p"), fake("d", tokens=20, delay=0.05)
    r = router([p], [d], "--max-in-flight", "4", "--admission-queue", "4", "--admission-wait", "0.2")
    with running(p, d, r), ThreadPoolExecutor(64) as pool:
        assert r.handle.pid is not None
        statuses = list(pool.map(lambda _: stream(r.url)[0], range(64)))
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 4 and statuses.count(429) >= 1
        refused = httpx.post(f"{r.url}/v1/completions", json={**BODY, "stream": False}, timeout=30)
        with ThreadPoolExecutor(32) as burst:
            burst_statuses = list(
                burst.map(lambda _: httpx.post(f"{r.url}/v1/completions", json=BODY, timeout=30).status_code, range(32))
            )
        assert 429 in burst_statuses, "the bound holds under a second burst"
        before = rss_kib(r.handle.pid)
        for _ in range(3):
            list(pool.map(lambda _: stream(r.url)[0], range(200)))
        growth_mib = (rss_kib(r.handle.pid) - before) / 1024
        assert growth_mib < 40, f"router RSS grew {growth_mib:.1f} MiB over 600 requests"
        assert refused.status_code in (200, 429)
        text = httpx.get(f"{r.url}/metrics", timeout=5).text
        assert "kvpush_admission_rejected_total" in text


def test_a_429_says_when_to_retry() -> None:
    p, d = fake("p"), fake("d", tokens=100, delay=0.05)
    r = router([p], [d], "--max-in-flight", "1", "--admission-queue", "0")
    with running(p, d, r), ThreadPoolExecutor(1) as pool:
        started = threading.Event()
        long = pool.submit(stream, r.url, {**BODY, "max_tokens": 100}, started)
        assert started.wait(20)
        refused = httpx.post(f"{r.url}/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert long.result()[0] == 200


def test_a_stopped_worker_is_ejected_and_readmitted_without_disturbing_the_others() -> None:
    p, d1, d2 = fake("p"), fake("d1", tokens=60, delay=0.05), fake("d2", tokens=60, delay=0.05)
    r = router([p], [d1, d2], ready="/ready")
    with running(p, d1, d2, r), ThreadPoolExecutor(8) as pool:
        started = [threading.Event() for _ in range(4)]
        long = [pool.submit(stream, r.url, {**BODY, "max_tokens": 60}, ev) for ev in started]
        assert all(ev.wait(20) for ev in started)
        d1.handle.stop(5.0)  # streams on d1 break; streams on d2 must not notice
        wait_for(lambda: not {w["url"]: w["healthy"] for w in ready(r.url).json()["workers"]}[d1.url], "d1 ejected")
        assert ready(r.url).status_code == 200, "d2 and p keep the router ready"
        during = [status for status, _ in pool.map(lambda _: stream(r.url), range(6))]  # 3 s streams: at once
        assert during == [200] * 6
        results = [f.result() for f in long]
        assert sum(1 for status, events in results if events and events[-1] == "[DONE]") >= 1
        d1_again = fake("d1", port=d1.port)
        with running(d1_again):
            wait_for(lambda: {w["url"]: w["healthy"] for w in ready(r.url).json()["workers"]}[d1.url], "d1 readmitted")
            p.handle.stop(5.0)
            wait_for(lambda: ready(r.url).status_code == 503, "/ready follows the prefill pool")
            p_again = fake("p", port=p.port)
            with running(p_again):
                wait_for(lambda: ready(r.url).status_code == 200, "/ready is back with a prefill")


def test_keys_guard_the_api_and_the_admin_api() -> None:
    p, d = fake("p"), fake("d")
    client_key, admin_key = "client-key-0123456789", "admin-key-9876543210"
    r = router([p], [d], "--api-key", client_key, env={"KVPUSH_ADMIN_KEY": admin_key})

    def as_(key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    with running(p, d, r), httpx.Client(base_url=r.url, timeout=10) as c:
        for headers in ({}, as_("wrong-key-000000"), as_(admin_key)):
            denied = c.post("/v1/completions", json={**BODY, "stream": False}, headers=headers)
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/completions", json={**BODY, "stream": False}, headers=as_(client_key)).status_code == 200
        assert c.get("/admin/workers", headers=as_(client_key)).status_code == 401
        assert c.get("/admin/workers").status_code == 401
        listed = c.get("/admin/workers", headers=as_(admin_key))
        assert listed.status_code == 200 and len(listed.json()["workers"]) == 2
        extra = fake("d-extra")
        with running(extra):
            added = c.post("/admin/workers", json={"role": "decode", "url": extra.url}, headers=as_(admin_key))
            assert added.status_code == 201
            assert c.post("/admin/workers/drain", json={"url": d.url}, headers=as_(admin_key)).status_code == 200
            for _ in range(3):
                ok = c.post("/v1/completions", json={**BODY, "stream": False}, headers=as_(client_key))
                assert ok.status_code == 200
            removed = c.post("/admin/workers/remove", json={"url": extra.url}, headers=as_(admin_key))
            assert removed.status_code == 200
            bad = c.post("/admin/workers", json={"role": "decode", "url": "ftp://x"}, headers=as_(admin_key))
            assert bad.status_code == 400
    log = r.handle.log_path.read_text()
    assert client_key not in log and admin_key not in log and "wrong-key-000000" not in log
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    served = [line for line in lines if line.get("outcome") == "ok"]
    assert (
        served
        and {"request_id", "pairing_id", "prefill_worker", "decode_worker", "mode", "ttft_ms", "e2e_ms"}
        <= served[0].keys()
    )


@pytest.mark.parametrize("fallback", ["none", "decode-only"])
def test_with_the_prefill_pool_down(fallback: str) -> None:
    p, d = fake("p"), fake("d")
    r = router([p], [d], "--fallback", fallback)
    with running(d, r):
        p.handle.stop(5.0)
        wait_for(
            lambda: not any(w["healthy"] for w in ready(r.url).json()["workers"] if w["role"] == "prefill"),
            "prefill pool reported down",
        )
        assert ready(r.url).status_code == (503 if fallback == "none" else 200)
        answer = httpx.post(f"{r.url}/v1/completions", json={**BODY, "stream": False}, timeout=20)
        if fallback == "none":
            assert answer.status_code == 503 and "prefill" in answer.json()["error"]["message"]
        else:
            assert answer.status_code == 200 and answer.json()["choices"]
            record = httpx.get(f"{r.url}/debug/timings", timeout=5).json()["requests"][-1]
            assert record["mode"] == "decode-only" and record["prefill_worker"] is None


def test_load_aware_selection_reads_scraped_engine_load() -> None:
    p, d1, d2 = fake("p"), fake("d1"), fake("d2")
    r = router([p], [d1, d2], "--scrape-interval", "0.2", "--decode-policy", "load-aware", ready="/ready")
    with running(p, d1, d2, r):
        wait_for(lambda: all(w["load"] is not None for w in ready(r.url).json()["workers"]), "every worker scraped")
        assert [stream(r.url)[0] for _ in range(4)] == [200] * 4
        d2.handle.stop(5.0)

        def text() -> str:
            return httpx.get(f"{r.url}/metrics", timeout=5).text

        wait_for(lambda: 'kvpush_scrape_errors_total{role="decode"}' in text(), "a failed scrape is counted")
