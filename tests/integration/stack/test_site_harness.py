"""stack/site/sitecustomize.py in a fresh interpreter, the way vLLM processes load it (real NIXL, real affinity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stack.engines import REPO_ROOT, vllm_env
from tests.integration.support import INTEGRATION

pytestmark = INTEGRATION

NIXL_PROBE = """
import json
from nixl._api import nixl_agent_config, nixl_thread_sync_t
vllm_style = nixl_agent_config(num_threads=4, capture_telemetry=True)
explicit = nixl_agent_config(enable_prog_thread=True, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
def name(mode):
    return mode.name if mode is not None else None
print(json.dumps({
    "vllm_style": [vllm_style.enable_pthread, name(vllm_style.sync_mode), vllm_style.num_threads],
    "explicit": [explicit.enable_pthread, name(explicit.sync_mode)],
}))
"""

AFFINITY_PROBE = """
import json, os
os.sched_setaffinity(0, {1})
moved_away = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {0, 1})
widened = sorted(os.sched_getaffinity(0))
print(json.dumps({"moved_away": moved_away, "widened": widened}))
"""


def run_probe(code: str, env: dict[str, str], core: int | None = None) -> dict[str, object]:
    prefix = ["taskset", "-c", str(core)] if core is not None else []
    done = subprocess.run(
        [*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_nixl_agents_default_to_no_progress_thread_and_strict_sync() -> None:
    pytest.importorskip("nixl", reason="needs nixl")
    env = vllm_env(core=0, side_port=None)
    assert run_probe(NIXL_PROBE, env) == {
        "vllm_style": [False, "NIXL_THREAD_SYNC_STRICT", 4],
        "explicit": [True, "NIXL_THREAD_SYNC_RW"],
    }


def test_without_the_switch_nixl_keeps_its_own_defaults() -> None:
    pytest.importorskip("nixl", reason="needs nixl")
    env = vllm_env(core=0, side_port=None)
    env["KVPUSH_NIXL_NO_PROG_THREAD"] = "0"
    assert run_probe(NIXL_PROBE, env)["vllm_style"] == [True, None, 4]  # None: NIXL picks NONE itself


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_affinity_stays_within_the_cores_the_process_started_on() -> None:
    env = vllm_env(core=0, side_port=None)
    assert run_probe(AFFINITY_PROBE, env, core=0) == {"moved_away": [0], "widened": [0]}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_without_the_switch_affinity_calls_are_untouched() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "stack" / "site"))
    assert run_probe(AFFINITY_PROBE, env, core=0) == {"moved_away": [1], "widened": [0, 1]}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_spread_engine_s_moves_stay_on_its_own_core_though_it_started_on_every_core() -> None:
    env = vllm_env(core=0, side_port=None)  # KVPUSH_KEEP_AFFINITY_CORES=0, started without taskset
    assert run_probe(AFFINITY_PROBE, env) == {"moved_away": [0], "widened": [0]}
