"""`kvpush stack` (what `make run` starts) for real: tiny model, prefill and decode vLLM on our connector, the
router; a streamed chat completion through the ready line's URL; SIGTERM leaves nothing listening.

Starts two engines: run under the vLLM flock, e.g.
    flock /tmp/kvpush-vllm.lock python -m pytest tests/integration/stack/test_local_vllm.py
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from typing import IO

import httpx
import pytest

from stack.engines import REPO_ROOT
from stack.procs import free_port, port_is_free
from tests.integration.support import CACHE, STARTUP_TIMEOUT, VLLM, require_vllm, wait_for

pytestmark = VLLM
SIDE_PORTS = (5600, 5601)  # the stack's fixed NIXL side channels (stack.local.StackOptions)


def read_line(stream: IO[str] | None, timeout: float) -> str:
    """One line from a child's pipe within `timeout` seconds ("" when the child closed it first)."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        pytest.fail(f"no line from `kvpush stack` within {timeout:g} s")
    return stream.readline()


def test_the_stack_serves_a_streamed_chat_through_its_router_and_stops_on_sigterm() -> None:
    require_vllm()
    if not all(port_is_free(port) for port in SIDE_PORTS):
        pytest.skip(f"the stack's side-channel ports {SIDE_PORTS} are taken (is `make run` up?)")
    ports = {name: free_port() for name in ("router", "prefill", "decode")}
    argv = [sys.executable, "-m", "stack.local", "--cache-dir", str(CACHE), "--startup-timeout", str(STARTUP_TIMEOUT)]
    argv += ["--port", str(ports["router"]), "--prefill-port", str(ports["prefill"])]
    argv += ["--decode-port", str(ports["decode"])]
    stack = subprocess.Popen(
        argv,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = read_line(stack.stdout, STARTUP_TIMEOUT * 2)  # the model build (cached), then both start waits
        assert line.startswith("kvpush stack ready: router http://127.0.0.1:"), line
        assert "connector KvpushConnector" in line  # push mode's default: ours
        url = re.search(r"router (http://\S+) ", line)
        assert url is not None and url[1] == f"http://127.0.0.1:{ports['router']}"
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "def fib(n):"}],
            "max_tokens": 8,
            "stream": True,
        }
        with httpx.stream("POST", f"{url[1]}/v1/chat/completions", json=body, timeout=120.0) as response:
            assert response.status_code == 200
            events = [json.loads(x[6:]) for x in response.iter_lines() if x.startswith("data: {")]
        assert events and any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events)
        stack.send_signal(signal.SIGTERM)
        _, err = stack.communicate(timeout=120)
    finally:
        stack.kill()
        stack.wait(timeout=30)
    assert stack.returncode == 0, err
    assert "stopped (SIGTERM)" in err
    every = (*ports.values(), *SIDE_PORTS)
    wait_for(lambda: all(port_is_free(port) for port in every), f"every stack port free again {every}", timeout=30)
