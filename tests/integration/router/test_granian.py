"""The router served by granian (`--server granian`, router/serve_granian.py): real router process, stand-in
workers (tests/integration/router/fake_worker.py, as test_operations.py uses them)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.router.test_operations import (
    BODY,
    fake,
    ready,
    router,
    running,
    sigterm_during_streams,
    stream,
)
from tests.integration.support import LOGS, wait_for

pytestmark = pytest.mark.integration
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}


def served_by_granian(name: str) -> bool:
    return "Starting granian" in (LOGS / f"{name}.log").read_text(errors="replace")


def test_granian_streams_a_chat_completion_and_answers_a_bad_request_openai_style() -> None:
    p, d = fake("p"), fake("d", tokens=5, delay=0.01)
    r = router([p], [d], "--server", "granian")
    with running(p, d, r), httpx.Client(base_url=r.url, timeout=30) as client:
        assert served_by_granian(r.handle.spec.name)
        with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert len(events) == 6 and events[-1] == "[DONE]"
        bad = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


def test_sigterm_under_granian_lets_streams_finish_refuses_new_connections_and_exits_zero() -> None:
    p, d = fake("p"), fake("d", tokens=40, delay=0.05)
    r = router([p], [d], "--server", "granian", "--drain-delay", "0.5", "--drain-grace", "20")
    with running(p, d, r), ThreadPoolExecutor(4) as pool:
        streams = sigterm_during_streams(pool, r, 4, 40)

        def refused() -> bool:
            try:
                ready(r.url)
            except httpx.TransportError:
                return True
            return False

        wait_for(refused, "the listener closes after the delay while the streams still run")
        assert not all(s.done() for s in streams)
        results = [s.result() for s in streams]
        assert all(status == 200 and events[-1] == "[DONE]" and len(events) == 41 for status, events in results)
        assert r.handle.stop(30.0) == 0


def test_a_stream_that_outlives_the_drain_grace_under_granian_is_cut_and_the_router_exits_zero() -> None:
    p, d = fake("p"), fake("d", tokens=400, delay=0.05)
    r = router([p], [d], "--server", "granian", "--drain-delay", "0", "--drain-grace", "1")
    with running(p, d, r), ThreadPoolExecutor(1) as pool:
        started = threading.Event()
        cut = pool.submit(stream, r.url, {**BODY, "max_tokens": 400}, started)
        assert started.wait(20), "the stream started"
        assert r.handle.pid is not None
        os.kill(r.handle.pid, signal.SIGTERM)
        assert r.handle.stop(15.0) == 0
        try:
            status, events = cut.result()
        except httpx.TransportError:  # the connection closed mid-body
            return
        assert status == 200 and "[DONE]" not in events and len(events) < 400
