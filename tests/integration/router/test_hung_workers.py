"""Hung and unresponsive workers (real router process, hostile stand-ins): issue 10's deadline bugs.

A hang is SIGSTOP on the worker's process group: the kernel still accepts its connections, nothing answers.
Every wait has a generous hang guard (30 s, far below the 120 s stream_idle / decode_first_byte defaults
that fire today); the guards are never speed assertions. What is asserted is the outcome the client gets
and the router's own record of it.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.router.hostile import (
    Proc,
    hostile,
    router_process,
    running,
    sockets_to,
    stop_all,
)
from tests.integration.support import wait_for

pytestmark = pytest.mark.integration
GUARD = 30.0  # hang guard per request, seconds: well under the 120 s defaults that fire on today's code
BODY: dict[str, Any] = {"model": "tiny", "prompt": "hello", "max_tokens": 6}
FAST_HEALTH = {"health_interval": 0.5, "timeouts": {"health": 1.0}}


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    yield
    stop_all()


@pytest.fixture
def kv_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvpush-kv-") as path:
        yield Path(path)


def post(url: str, body: dict[str, Any], timeout: float = GUARD) -> tuple[int, str, dict[str, str]]:
    """One request; a stream is read to its end. Raises httpx.TimeoutException past the hang guard."""
    with httpx.Client(timeout=timeout) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        return r.status_code, r.read().decode(errors="replace"), dict(r.headers)


def busy(workers: list[Proc]) -> Proc | None:
    """The stand-in that has a completion running (its /stats say so), if any."""
    for worker in workers:
        stats = worker.stats()
        if stats["running"] > 0:
            return worker
    return None


def timing_of(router: Proc, request_id: str) -> dict[str, Any]:
    records = httpx.get(f"{router.url}/debug/timings", params={"request_id": request_id}, timeout=5).json()
    (record,) = records["requests"]
    return dict(record)


def hang_the_busy_one(workers: list[Proc], what: str) -> Proc:
    found: list[Proc] = []

    def check() -> bool:
        worker = busy(workers)
        if worker is not None:
            found.append(worker)
        return worker is not None

    wait_for(check, what, timeout=GUARD)
    worker = found[-1]
    worker.hang()
    return worker


def served_or_refused(status: int, text: str) -> bool:
    """The client got its answer (a stream to [DONE] or a JSON completion) or a clear 503/504 error."""
    if status == 200:
        return "[DONE]" in text or '"choices"' in text
    if status in (503, 504):
        return isinstance(json.loads(text).get("error"), dict)
    return False


def in_background(work: Callable[[], tuple[int, str, dict[str, str]]]) -> Any:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(work)
    pool.shutdown(wait=False)
    return future


@pytest.mark.parametrize("stream", [True, False])
def test_a_prefill_that_hangs_mid_request_is_routed_around_long_before_stream_idle(kv_dir: Path, stream: bool) -> None:
    prefills = [hostile(f"p{i}", kv_dir=kv_dir, prefill_delay=1.5) for i in range(2)]
    decode = hostile("d", kv_dir=kv_dir)
    r = router_process(prefills, [decode], FAST_HEALTH)
    with running(r, *prefills, decode):
        request_id = f"hung-prefill-{stream}"
        body = {**BODY, "stream": stream}
        t0 = time.monotonic()
        future = in_background(lambda: post_with_id(r.url, body, request_id))
        hung = hang_the_busy_one(prefills, "a prefill got the request")
        hung_at = time.monotonic()
        try:
            status, text, _ = future.result(timeout=GUARD + 5)
        except httpx.TimeoutException:
            pytest.fail(f"no answer within the {GUARD:g} s hang guard after the prefill hung (today: 120 s)")
        assert served_or_refused(status, text), (status, text[:300])
        record = timing_of(r, request_id)
        assert record["outcome"] in ("ok", "no_worker", "timeout"), record
        if status == 200:
            other = next(p for p in prefills if p is not hung)
            assert other.stats()["finished"] >= 1, "the retry went to the other prefill"
        print(
            f"fault matrix: hung prefill -> {status} {time.monotonic() - hung_at:.2f} s after the hang "
            f"({hung_at - t0:.2f} s after the request)"
        )


def post_with_id(url: str, body: dict[str, Any], request_id: str) -> tuple[int, str, dict[str, str]]:
    with (
        httpx.Client(timeout=GUARD) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}) as r,
    ):
        return r.status_code, r.read().decode(errors="replace"), dict(r.headers)


def test_a_decode_that_hangs_before_its_first_byte_is_routed_around(kv_dir: Path) -> None:
    prefill = hostile("p", kv_dir=kv_dir)
    decodes = [hostile(f"d{i}", kv_dir=kv_dir, first_byte_delay=1.5) for i in range(2)]
    r = router_process([prefill], decodes, FAST_HEALTH)
    with running(r, prefill, *decodes):
        future = in_background(lambda: post_with_id(r.url, {**BODY, "stream": True}, "hung-decode"))
        hung = hang_the_busy_one(decodes, "a decode got the request")
        try:
            status, text, _ = future.result(timeout=GUARD + 5)
        except httpx.TimeoutException:
            pytest.fail(f"no answer within the {GUARD:g} s hang guard after the decode hung (today: 120 s)")
        assert served_or_refused(status, text), (status, text[:300])
        assert timing_of(r, "hung-decode")["outcome"] in ("ok", "no_worker", "timeout")
        if status == 200:
            other = next(d for d in decodes if d is not hung)
            assert other.stats()["finished"] >= 1


def test_a_worker_that_never_reads_a_large_request_has_its_connection_closed(kv_dir: Path) -> None:
    prefill = hostile("p", "never-read")
    decode = hostile("d", kv_dir=kv_dir)
    config = {"timeouts": {"prefill": 1.0}, "eject_after": 100, "retries": 0}
    r = router_process([prefill], [decode], config)
    with running(r, prefill, decode):
        big = {**BODY, "prompt": "x" * (8 * 2**20)}  # well over the socket buffers, under the 16 MiB limit
        statuses = [post(r.url, big)[0] for _ in range(5)]
        assert all(s in (502, 503, 504) for s in statuses), statuses
        assert prefill.stats()["started"] >= 1
        wait_for(
            lambda: sockets_to(r.pid, prefill.port) <= 1,  # at most a pooled health-probe connection
            lambda: (
                f"the router closed its leg connections to the never-reading prefill (holds "
                f"{sockets_to(r.pid, prefill.port)}; asyncio's transport.close() waits forever for an unsent body: "
                "a leg given up mid-upload must abort() its connection: e.g. keep conn.transport from a "
                "TCPConnector.connect override and call transport.abort(); checked to free all 3 of 3 sockets)"
            ),
            timeout=10.0,
        )


@pytest.mark.parametrize(
    ("config", "worker", "stream"),
    [
        pytest.param(
            {"timeouts": {"stream_idle": 1.0, "prefill": 8.0}}, {"prefill_delay": 2.5}, True, id="prefill-leg"
        ),
        pytest.param(
            {"timeouts": {"stream_idle": 1.0, "decode_total": 8.0}},
            {"tokens": 25, "delay": 0.1},
            False,
            id="non-streamed-decode",
        ),
        pytest.param(
            {"timeouts": {"stream_idle": 1.0, "decode_first_byte": 8.0}},
            {"first_byte_delay": 2.5},
            True,
            id="decode-first-byte",
        ),
    ],
)
def test_each_upstream_deadline_is_the_one_that_fires_not_stream_idle(
    kv_dir: Path, config: dict[str, Any], worker: dict[str, float], stream: bool
) -> None:
    """A leg slower than stream_idle but within its own deadline succeeds, three times in a row (no ejection)."""
    prefill_flags = {k: v for k, v in worker.items() if k == "prefill_delay"}
    decode_flags = {k: v for k, v in worker.items() if k != "prefill_delay"}
    prefill = hostile("p", kv_dir=kv_dir, **prefill_flags)
    decode = hostile("d", kv_dir=kv_dir, **decode_flags)
    r = router_process([prefill], [decode], config)
    with running(r, prefill, decode):
        for _ in range(3):
            status, text, _ = post(r.url, {**BODY, "stream": stream})
            assert status == 200 and ("[DONE]" in text or '"choices"' in text), (status, text[:300])
            assert '"error"' not in text


def test_pins_a_prefill_slower_than_its_own_deadline_is_a_504_naming_the_prefill(kv_dir: Path) -> None:
    """Passes today; pins that the prefill deadline itself still fires."""
    prefill = hostile("p", kv_dir=kv_dir, prefill_delay=5.0)
    decode = hostile("d", kv_dir=kv_dir)
    r = router_process([prefill], [decode], {"timeouts": {"prefill": 1.0}, "retries": 0})
    with running(r, prefill, decode):
        status, text, _ = post(r.url, {**BODY, "stream": True})
        assert status == 504 and "prefill" in json.loads(text)["error"]["message"], (status, text)


def test_pins_stream_idle_still_cuts_a_silent_stream_after_its_first_event(kv_dir: Path) -> None:
    """Passes today; pins what stream_idle is for: silence between two events of a decode stream."""
    prefill = hostile("p", kv_dir=kv_dir)
    decode = hostile("d", kv_dir=kv_dir, tokens=3, delay=4.0)
    r = router_process([prefill], [decode], {"timeouts": {"stream_idle": 1.0}})
    with running(r, prefill, decode):
        status, text, _ = post(r.url, {**BODY, "stream": True})
        assert status == 200 and '"error"' in text and "[DONE]" not in text, (status, text[:300])


def test_credentials_in_an_admin_added_url_are_refused_and_ejected_workers_still_come_back(kv_dir: Path) -> None:
    prefill = hostile("p", kv_dir=kv_dir)
    decodes = [hostile(f"d{i}", kv_dir=kv_dir) for i in range(2)]
    admin = "admin-key-9876543210"
    r = router_process([prefill], decodes, {**FAST_HEALTH, "admin_key": admin})
    auth = {"authorization": f"Bearer {admin}"}

    def healthy(url: str) -> bool:
        workers = httpx.get(f"{r.url}/ready", timeout=5).json()["workers"]
        return bool({w["url"]: w["healthy"] for w in workers}[url])

    with running(r, prefill, *decodes):
        spare = decodes[1].url.replace("http://", "http://user:secret@")
        added = httpx.post(f"{r.url}/admin/workers", json={"role": "decode", "url": spare}, headers=auth, timeout=10)
        assert added.status_code == 400, (added.status_code, added.text)
        assert "secret" not in added.text
        probed = decodes[0].stats()["health_probes"]
        wait_for(
            lambda: decodes[0].stats()["health_probes"] >= probed + 3,
            "three more health rounds run with whatever the admin call left behind",
            timeout=GUARD,
        )
        decodes[0].hang()
        wait_for(lambda: not healthy(decodes[0].url), "a hung decode is marked down", timeout=GUARD)
        decodes[0].resume()
        wait_for(lambda: healthy(decodes[0].url), "the decode comes back once it answers again", timeout=GUARD)
        text = httpx.get(f"{r.url}/metrics", timeout=5).text
        assert "secret" not in text and "secret" not in httpx.get(f"{r.url}/ready", timeout=5).text
    assert "secret" not in r.handle.log_path.read_text()


def test_health_loop_survives_a_non_httpx_error_from_a_credentialed_url(kv_dir: Path) -> None:
    """Even if a credentialed URL got in (it must not), the health loop keeps running: ejected workers return."""
    prefill = hostile("p", kv_dir=kv_dir)
    decodes = [hostile(f"d{i}", kv_dir=kv_dir) for i in range(2)]
    admin = "admin-key-9876543210"
    r = router_process([prefill], decodes, {**FAST_HEALTH, "admin_key": admin})
    with running(r, prefill, *decodes):
        spare = decodes[1].url.replace("http://", "http://user:secret@")
        httpx.post(
            f"{r.url}/admin/workers",
            json={"role": "decode", "url": spare},
            headers={"authorization": f"Bearer {admin}"},
            timeout=10,
        )
        decodes[0].hang()

        def state(url: str) -> bool | None:
            workers = httpx.get(f"{r.url}/ready", timeout=5).json()["workers"]
            return {w["url"]: w["healthy"] for w in workers}.get(url)

        wait_for(lambda: state(decodes[0].url) is False, "the hung decode is marked down", timeout=GUARD)
        decodes[0].resume()
        wait_for(lambda: state(decodes[0].url) is True, "the decode comes back", timeout=GUARD)
