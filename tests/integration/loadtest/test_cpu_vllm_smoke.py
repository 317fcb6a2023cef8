"""The cpu-vllm suite, tiny and on one pair: our push pair (KvpushConnector) behind our router and vllm-router.

It proves the suite's machinery does not rot (repeats in reversed order, the concurrency probe, KV by transfer);
the connectors themselves are covered by tests/integration/test_pd_e2e.py, so one pair (two engines) is enough.
Takes a minute or two and holds /tmp/kvpush-vllm.lock while it runs (unless an ancestor holds it).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from loadtest.bench.procs import vrouter_binary
from loadtest.bench.run import run_suites

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("router") is None, reason="the router package is not importable yet"),
]


def test_cpu_vllm_smoke(tmp_path: Path) -> None:
    assert run_suites("cpu-vllm", smoke=True, results=tmp_path, progress=False, overrides=["pairs=kvpush-push"]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    fronts = {(r["router"], r["mode"], r["connector"]) for r in rows}
    routers = {"kvpush", "vllm-router"} if vrouter_binary() is not None else {"kvpush"}
    assert fronts == {(router, "push", "kvpush-push") for router in routers}  # the one pair asked for, no other
    # every point twice, the second time with the fronts in reverse order
    assert sorted({r["repeat"] for r in rows}) == [0, 1]
    first = sorted((r["order"], r["router"], r["connector"]) for r in rows if r["repeat"] == 0)
    second = sorted((r["order"], r["router"], r["connector"]) for r in rows if r["repeat"] == 1)
    assert [x[1:] for x in first] == [x[1:] for x in second][::-1]
    for r in rows:  # recorded for the report; on a shared box its timing verdict is noise-prone
        assert r["concurrency_probe"]["status"] == 200, (r["router"], r["connector"], r["concurrency_probe"])
    for r in rows:
        assert r["failed"] == 0, (r["router"], r["mode"], r["errors"])
        assert r["kv_external_frac"] == 1.0  # decode received every prompt token by KV transfer
