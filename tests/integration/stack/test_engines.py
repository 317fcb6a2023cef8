"""A real vLLM CPU engine started, used and stopped through stack.engines (run under the vLLM flock).

At most one engine runs at a time here. Run as:
    flock /tmp/kvpush-vllm.lock python -m pytest -m vllm tests/integration/stack
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stack.engines import Engine, EngineSpec, Fleet
from stack.procs import StartupError
from tests.integration.support import STARTUP_TIMEOUT, VLLM, require_vllm

pytestmark = VLLM


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def cpus_allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of a process."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return found


def test_single_engine_serves_greedy_completions_and_stops_without_leftovers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    require_vllm()
    spec = EngineSpec(name="single", role="single", model=tiny_model_dir, core=0)
    with Fleet(tmp_path, spread_start=True) as fleet:  # started on every core: pinned to core 0 once ready
        (engine,) = fleet.start_all([spec])
        fleet.wait_all_healthy(STARTUP_TIMEOUT)
        body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = post_json(f"{engine.url}/v1/completions", body)
        second = post_json(f"{engine.url}/v1/completions", body)
        members = engine.group_alive()
        pinned = set().union(*(cpus_allowed(pid) for pid in members))
    assert first["usage"]["completion_tokens"] == 8
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy on fixed weights
    assert len(members) >= 2  # the API server and its engine-core child share the group
    assert pinned == {"0"}  # every thread of the whole instance stays on its core
    assert engine.group_alive() == []
    assert engine.exit_code() is not None


def test_a_bad_model_path_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    require_vllm()
    missing = tmp_path / "no-such-model"
    engine = Engine(EngineSpec(name="bad", role="single", model=missing, core=0), log_dir=tmp_path)
    engine.start()
    try:
        with pytest.raises(StartupError) as info:
            engine.wait_healthy(STARTUP_TIMEOUT)
    finally:
        engine.stop(grace=10.0)
    assert info.value.reason.startswith("exited with status")
    assert len(info.value.tail) == 40
    assert str(missing) in "\n".join(info.value.tail)
    assert engine.group_alive() == []
