"""A real router process (`python -m router serve`) in front of stand-in workers: its /metrics, after real
traffic, passes `promtool check metrics` and exports every router series the dashboard and alerts query."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stack.engines import Fleet, prefill_arg
from stack.procs import ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, router_spec
from tests.integration.support import INTEGRATION, LOGS, REPO
from tests.unit.deploy import promql

pytestmark = INTEGRATION

HERE = Path(__file__).resolve().parent
# The router's series that the observability work promised (deploy/README.md sections 5-7: the dashboard and the
# alerts are built on these).
ROUTER_SERIES = [
    "kvpush_requests_total",
    "kvpush_ttft_seconds_bucket",
    "kvpush_decode_ttft_seconds_bucket",
    "kvpush_e2e_seconds_bucket",
    "kvpush_leg_seconds_bucket",
    "kvpush_handoff_seconds_bucket",
    "kvpush_worker_in_flight",
    "kvpush_worker_healthy",
    "kvpush_pool_members",
    "kvpush_pool_healthy",
    "kvpush_ejections_total",
    "kvpush_in_flight",
    "kvpush_admission_queued",
    "kvpush_admission_rejected_total",
    "kvpush_scrape_errors_total",
    "kvpush_errors_total",
    "kvpush_retries_total",
    "kvpush_draining",
]


def fake_worker(tag: str, port: int, *flags: str) -> ManagedProcess:
    """fake_vllm.py on port (its log: deploy-fake-<tag>-<port>.log)."""
    name = f"deploy-fake-{tag}-{port}"
    argv = (sys.executable, str(HERE / "fake_vllm.py"), "--port", str(port), *flags)
    return ManagedProcess(
        ProcessSpec(name, argv, dict(os.environ), LOGS / f"{name}.log", f"http://127.0.0.1:{port}/health", REPO)
    )


def traffic(base: str) -> None:
    """Streamed and non-streamed completions and chat completions (one prefill fails once: a retry), and one
    request that is not JSON (a client error)."""
    with httpx.Client(base_url=base, timeout=30.0) as client:
        for i in range(6):
            path, body = (
                ("/v1/completions", {"model": "tiny", "prompt": f"hello {i}"})
                if i % 2
                else ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}]})
            )
            response = client.post(path, json={**body, "max_tokens": 3, "stream": i % 3 == 0})
            assert response.status_code == 200, response.text
        bad = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400


@pytest.fixture(scope="module")
def router_metrics() -> Iterator[str]:
    """Starts two prefill stand-ins (one fails its first request), a decode stand-in and the router; sends
    streamed, non-streamed and invalid requests through it; yields the router's /metrics text."""
    ports = {name: free_port() for name in ("p0", "p1", "d0", "router")}
    prefills = [
        prefill_arg(f"http://127.0.0.1:{ports['p0']}", "fake-p0", 5600),
        prefill_arg(f"http://127.0.0.1:{ports['p1']}", "fake-p1", 5601),
    ]
    decodes = [f"http://127.0.0.1:{ports['d0']}"]
    spec = router_spec(
        ports["router"], "push", prefills, decodes, "--health-interval", "0.5", name=f"deploy-router-{ports['router']}"
    )
    with Fleet(LOGS, stop_grace=10.0) as fleet:
        fleet.start(fake_worker("p0", ports["p0"], "--role", "prefill", "--engine-id", "fake-p0"))
        fleet.start(fake_worker("p1", ports["p1"], "--role", "prefill", "--engine-id", "fake-p1", "--fail-first", "1"))
        fleet.start(fake_worker("d0", ports["d0"], "--role", "decode"))
        router = fleet.start(Router(spec, log_dir=LOGS))
        fleet.wait_all_healthy(60.0)
        traffic(router.url)
        yield httpx.get(f"{router.url}/metrics", timeout=10.0).text


def test_promtool_check_metrics_passes_on_a_live_router_scrape(router_metrics: str) -> None:
    promtool = promql.require_promtool()
    done = subprocess.run(
        [promtool, "check", "metrics"], input=router_metrics, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_live_router_exports_every_series_the_deploy_guide_names(router_metrics: str) -> None:
    page = promql.Exposition(router_metrics)
    missing = [name for name in ROUTER_SERIES if not page.exports(name)]
    assert not missing, f"the router's /metrics has no {missing}"
    requests = page.labels_of("kvpush_requests_total")
    assert requests == {"endpoint", "mode", "outcome"}  # samples are there: traffic went through


def test_every_router_series_the_dashboard_and_alerts_query_is_exported(router_metrics: str) -> None:
    page = promql.Exposition(router_metrics)
    checked = 0
    for where, expr in promql.all_exprs():
        found = promql.usage(expr)
        for selector in found.selectors:
            if not selector.name.startswith("kvpush_"):
                continue
            assert page.exports(selector.name), f"{where}: the live router does not export {selector.name}"
            labels = page.labels_of(selector.name)
            if labels is not None:  # a family without samples yet says nothing about its labels
                unknown = selector.matchers - labels - promql.TARGET_LABELS
                assert not unknown, f"{where}: {selector.name} has no label(s) {unknown} on the live router"
            checked += 1
        known = [page.labels_of(s.name) for s in found.selectors]
        if found.selectors and all(s.name.startswith("kvpush_") for s in found.selectors) and None not in known:
            have = set().union(*(k for k in known if k is not None)) | promql.TARGET_LABELS
            assert found.grouping <= have, f"{where}: groups by {found.grouping - have}"
    assert checked > 20
