"""The cpu-vllm suite, tiny: real vLLM CPU pairs (pull, then push) behind our router and vllm-router.

Takes minutes (engines boot in about a minute per pair) and holds /tmp/kvpush-vllm.lock while it runs.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from loadtest.bench import run_suites
from loadtest.benchkit import vrouter_binary

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("router") is None, reason="the router package is not importable yet"),
]


def test_cpu_vllm_smoke(tmp_path: Path) -> None:
    assert run_suites("cpu-vllm", smoke=True, results=tmp_path, progress=False) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    fronts = {(r["router"], r["mode"], r["connector"]) for r in rows}
    assert {("kvpush", "pull", "upstream-pull"), ("kvpush", "push", "upstream-push")} <= fronts
    if vrouter_binary() is not None:
        assert ("vllm-router", "pull", "upstream-pull") in fronts
    for r in rows:
        assert r["failed"] == 0, (r["router"], r["mode"], r["errors"])
        assert r["kv_external_frac"] == 1.0  # decode received every prompt token by KV transfer
