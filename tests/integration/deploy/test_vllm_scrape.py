"""A real vLLM CPU prefill engine with the NIXL push connector (kv_producer), as the prefill pool runs it: every
vllm:* series the dashboard and alerts query is on its /metrics, with the labels they use.

The engine is p0 of the session's shared push family (`UPSTREAM_PUSH`, tests/integration/families.py; started
under /tmp/kvpush-vllm.lock unless a parent holds it): this module sends it a plain request and a prefill-leg
request and scrapes it.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.integration.families import UPSTREAM_PUSH, FamilyPool
from tests.integration.support import VLLM
from tests.integration.vllm_support import prompt_text
from tests.unit.deploy import promql

pytestmark = [*VLLM, pytest.mark.family(UPSTREAM_PUSH)]


@pytest.fixture(scope="module")
def vllm_metrics(family_pool: FamilyPool) -> str:
    engine = family_pool.get(UPSTREAM_PUSH).engines.prefills[0]
    spec = engine.engine_spec
    assert spec.connector == "NixlPushConnector" and spec.effective_kv_role == "kv_producer", spec
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
        assert params.get("remote_engine_id") == spec.engine_id, f"push connector not active: {leg.text}"
        return client.get("/metrics").text


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
