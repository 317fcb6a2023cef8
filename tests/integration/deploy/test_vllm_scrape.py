"""A real vLLM CPU prefill engine with the NIXL push connector (kv_producer), as the prefill pool runs it: every
vllm:* series the dashboard and alerts query is on its /metrics, with the labels they use.

Starts one engine (about 30 s on the test box) under /tmp/kvpush-vllm.lock (taken here unless a parent such as
`flock /tmp/kvpush-vllm.lock pytest ...` holds it already), sends it a plain request and a
prefill-leg request, scrapes, stops it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from loadtest.bench.procs import vllm_lock
from stack.engines import EngineSpec, Fleet
from tests.integration.support import LOGS, STARTUP_TIMEOUT, VLLM, require_vllm, tiny_model
from tests.integration.vllm_support import prompt_text
from tests.unit.deploy import promql

pytestmark = VLLM


@pytest.fixture(scope="module")
def vllm_metrics() -> Iterator[str]:
    require_vllm()
    model = tiny_model()
    spec = EngineSpec(
        name=f"deploy-prefill-{uuid.uuid4().hex[:6]}",
        role="prefill",
        model=model,
        core=0,
        connector="NixlPushConnector",
        kv_role="kv_producer",
        engine_id="deploy-p0",
    )
    with vllm_lock(), Fleet(LOGS) as fleet:
        (engine,) = fleet.start_all([spec])
        fleet.wait_all_healthy(STARTUP_TIMEOUT)
        with httpx.Client(base_url=engine.url, timeout=120.0) as client:
            body = {"model": "tiny", "prompt": prompt_text(20), "max_tokens": 3, "temperature": 0}
            plain = client.post("/v1/completions", json=body)
            assert plain.status_code == 200, plain.text
            leg = client.post(
                "/v1/completions",
                headers={"X-Request-Id": f"deploy-{uuid.uuid4().hex}"},
                json={
                    **body,
                    "prompt": prompt_text(20),
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"xfer-{uuid.uuid4().hex}"},
                },
            )
            assert leg.status_code == 200, leg.text
            params = leg.json().get("kv_transfer_params") or {}
            assert params.get("remote_engine_id") == "deploy-p0", f"push connector not active: {leg.text}"
            yield client.get("/metrics").text


def test_every_vllm_series_the_dashboard_and_alerts_query_is_exported(vllm_metrics: str) -> None:
    page = promql.Exposition(vllm_metrics)
    checked = 0
    for where, expr in promql.all_exprs():
        found = promql.usage(expr)
        engine_selectors = [s for s in found.selectors if s.name.startswith("vllm:")]
        for selector in engine_selectors:
            assert page.exports(selector.name), f"{where}: vLLM does not export {selector.name}"
            labels = page.labels_of(selector.name)
            assert labels is not None, f"{where}: {selector.name} has no samples on a used engine"
            unknown = selector.matchers - labels - promql.TARGET_LABELS
            assert not unknown, f"{where}: {selector.name} has no label(s) {unknown}"
            ungrouped = found.grouping - labels - promql.TARGET_LABELS
            assert not ungrouped, f"{where}: groups {selector.name} by {ungrouped}, which it does not carry"
            checked += 1
    assert checked >= 10


def test_the_prompt_token_sources_the_dashboard_explains_are_the_engine_s(vllm_metrics: str) -> None:
    sources = {
        line.split('source="')[1].split('"')[0]
        for line in vllm_metrics.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total{")
    }
    assert {"external_kv_transfer", "local_compute", "local_cache_hit"} <= sources
