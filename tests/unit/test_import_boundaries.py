"""Pure modules stay pure: importing them loads none of the heavy or I/O libraries (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("fastapi", "starlette", "httpx", "prometheus_client", "vllm", "nixl", "torch", "uvicorn")
PURE = {
    "router.domain": HEAVY,
    "router.errors": HEAVY,
    "router.policy": HEAVY,
    "router.config": HEAVY,
    "router.protocol": HEAVY,
    "router.sse": HEAVY,
    "router.timings": HEAVY,
    "connector.rendezvous": (*HEAVY, "threading"),
}


def loaded_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return {name.split(".")[0] for name in json.loads(out.stdout)}


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_module_imports_nothing_heavy(module: str) -> None:
    pytest.importorskip(module)
    banned = set(PURE[module]) & loaded_after_import(module)
    assert not banned, f"{module} pulls in {sorted(banned)}"


def test_only_app_imports_fastapi() -> None:
    assert "fastapi" not in loaded_after_import("router.dispatch")
