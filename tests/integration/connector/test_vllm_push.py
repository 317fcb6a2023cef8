"""Our connector on real vLLM CPU: a prefill and a decode engine, push flow driven like the router.

The engines are the package's family (conftest.py), started once; these tests use prefill p0 and the decode.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.connector.kvpush_support import Engines
from tests.integration.vllm_support import kv_sources, metric, prompt_text

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture
def kvpush_pair(kvpush_family: Engines) -> Engines:
    return kvpush_family


def post(url: str, body: dict[str, Any], request_id: str, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=timeout)


def push(p: Engines, body: dict[str, Any], transfer_id: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, same X-Request-Id, as the router sends them."""
    rid, tid = str(uuid.uuid4()), transfer_id or f"xfer-{uuid.uuid4()}"
    prefill = p.prefills[0]
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    d_params = {
        "do_remote_prefill": True, "remote_engine_id": prefill.engine_spec.engine_id, "remote_host": "127.0.0.1",
        "remote_port": prefill.engine_spec.side_port, "tp_size": 1, "pp_size": 1, "remote_request_id": rid,
        "transfer_id": tid,
    }  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        d_future = pool.submit(post, p.decode.url, dict(body, kv_transfer_params=d_params), rid)
        p_future = pool.submit(post, prefill.url, p_body, rid)
        return p_future.result(), d_future.result()


def body(words: int = 60, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt_text(words), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


def test_push_output_equals_single_instance_and_kv_came_from_prefill(kvpush_pair: Engines) -> None:
    p = kvpush_pair
    b = body()
    before = kv_sources(p.decode.url)
    p_res, d_res = push(p, b)
    assert p_res.status_code == 200, p_res.text
    assert d_res.status_code == 200, d_res.text
    assert p_res.json()["kv_transfer_params"]["transfer_mode"] == "push"
    time.sleep(0.5)
    after = kv_sources(p.decode.url)
    prompt_tokens = d_res.json()["usage"]["prompt_tokens"]
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] <= 1  # vLLM recomputes at most the last token
    reference = post(p.prefills[0].url, b, str(uuid.uuid4())).json()
    assert d_res.json()["choices"][0]["text"] == reference["choices"][0]["text"]


def test_sixteen_concurrent_pushes(kvpush_pair: Engines) -> None:
    p = kvpush_pair
    before = kv_sources(p.decode.url)["external_kv_transfer"]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: push(p, body(40, 8)), range(16)))
    assert all(r.status_code == 200 for pair_ in results for r in pair_), [r.text for pr in results for r in pr]
    time.sleep(0.5)
    sent = sum(d.json()["usage"]["prompt_tokens"] for _, d in results)
    assert kv_sources(p.decode.url)["external_kv_transfer"] - before == sent
    assert metric(p.prefills[0].url, "vllm:kvpush_xfer_time_seconds_count") >= 16


def wait_idle(url: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while True:
        busy = {name: metric(url, name) for name in
                ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}  # fmt: skip
        if not any(busy.values()):
            return
        assert time.monotonic() < end, f"{url} not idle: {busy}"
        time.sleep(0.25)


def test_decode_disconnect_before_prefill_is_cancelled_and_leaks_nothing(kvpush_pair: Engines) -> None:
    """Decode registers, its client leaves before any prefill: D cancels, P acks, D frees its blocks;
    the late prefill leg of that transfer is refused a pairing and P frees its blocks at once."""
    p = kvpush_pair
    prefill = p.prefills[0]
    rid, tid = str(uuid.uuid4()), f"xfer-{uuid.uuid4()}"
    b = body()
    d_params = {
        "do_remote_prefill": True, "remote_engine_id": prefill.engine_spec.engine_id, "remote_host": "127.0.0.1",
        "remote_port": prefill.engine_spec.side_port, "tp_size": 1, "pp_size": 1, "remote_request_id": rid,
        "transfer_id": tid,
    }  # fmt: skip
    with pytest.raises(httpx.TimeoutException):
        post(p.decode.url, dict(b, kv_transfer_params=d_params), rid, timeout=2.0)
    wait_idle(p.decode.url)
    late = post(prefill.url, dict(b, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}),
                rid)  # fmt: skip
    assert late.status_code == 200
    wait_idle(prefill.url)
    assert metric(prefill.url, "vllm:kvpush_cancelled_total") >= 1
