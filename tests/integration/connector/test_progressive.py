"""Progressive push (guarantee G14) on real vLLM CPU: one small pair of our connector, a chunked prefill.

The prefill engine computes at most CHUNK tokens a step (``--max-num-batched-tokens``), so the test prompt
spans at least three prefill steps. Both legs go straight to the engines, as the router sends them: the
decode leg first (its registration is at the prefill before the prefill leg starts), then the prefill leg.
Checked: P posted more than one WRITE for the request (``vllm:kvpush_writes_posted_total``, of which
``vllm:kvpush_partial_writes_total`` without Done), decode counted the whole prompt as
``external_kv_transfer`` and its greedy answer equals one instance's. Cost: one pair start (about a
minute on two cores) and three requests.
"""

from __future__ import annotations

import fcntl
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from stack.engines import Engine, Fleet
from stack.family import PdEngines, pd_family, start_family
from tests.integration.support import CACHE, LOGS, STARTUP_TIMEOUT, VLLM, metric, require_vllm, tiny_model, wait_for

pytestmark = VLLM

CHUNK = 64  # prompt tokens a prefill step computes at most
BLOCK = 32  # tokens per KV block on both engines (the CPU backend wants multiples of 32)
CONNECTOR_EXTRA = {"progressive": True, "kv_timeout_s": 45.0}
WRITES = "vllm:kvpush_writes_posted_total"
PARTIAL = "vllm:kvpush_partial_writes_total"


@pytest.fixture(scope="module")
def engines() -> Iterator[PdEngines]:
    require_vllm()
    CACHE.mkdir(parents=True, exist_ok=True)
    family = pd_family(
        "prog",
        tiny_model(),
        "KvpushConnector",
        module="connector.plugin",
        engine_suffix=f"-{uuid.uuid4().hex[:6]}",
        extra_args=("--block-size", str(BLOCK)),
        prefill_args=[("--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "2")],
        connector_extra=CONNECTOR_EXTRA,
    )
    with open(CACHE / "vllm-pair.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other vLLM families of this test run stay off the two cores
        with Fleet(LOGS) as fleet:
            yield start_family(fleet, family, STARTUP_TIMEOUT)


def prompt(items: int) -> str:
    """A prompt no engine has seen (no prefix-cache hit shortens the prefill)."""
    return f"# {uuid.uuid4().hex}\n" + " ".join(f"def f{i}(x): return x * {i}" for i in range(items))


def post(engine: Engine, body: dict[str, Any], request_id: str) -> httpx.Response:
    headers = {"X-Request-Id": request_id}
    return httpx.post(f"{engine.url}/v1/completions", json=body, headers=headers, timeout=120.0)


def push(engines: PdEngines, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """The decode leg, then (once decode holds the request) the prefill leg: same request id and transfer id."""
    p, d = engines.prefills[0], engines.decode
    rid, tid = f"prog-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    d_params = {
        "do_remote_prefill": True,
        "remote_engine_id": p.engine_spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.engine_spec.side_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": rid,
        "transfer_id": tid,
    }
    p_body = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    with ThreadPoolExecutor(1) as pool:
        d_leg = pool.submit(post, d, dict(body, kv_transfer_params=d_params), rid)
        wait_for(lambda: metric(d.url, "vllm:num_requests_waiting") >= 1, "decode holds the request")
        time.sleep(0.5)  # its registration travels to the prefill (not a timing assertion)
        p_res = post(p, p_body, rid)
        return p_res, d_leg.result()


def transferred(engines: PdEngines) -> dict[str, float]:
    return {
        source: metric(engines.decode.url, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("external_kv_transfer", "local_compute")
    }


def test_a_chunked_prefill_is_pushed_step_by_step_and_decode_answers_as_one_instance(engines: PdEngines) -> None:
    p = engines.prefills[0]
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    warm_p, warm_d = push(engines, dict(body, prompt=prompt(2), max_tokens=2))  # side channel up, agents loaded
    assert warm_p.status_code == 200 and warm_d.status_code == 200, (warm_p.text, warm_d.text)
    wait_for(lambda: metric(p.url, WRITES) >= 1, "the warm-up WRITE is counted")
    writes, partial, before = metric(p.url, WRITES), metric(p.url, PARTIAL), transferred(engines)

    b = dict(body, prompt=prompt(24))
    p_res, d_res = push(engines, b)
    assert p_res.status_code == 200, p_res.text
    assert d_res.status_code == 200, d_res.text
    assert p_res.json()["kv_transfer_params"]["transfer_mode"] == "push"
    prompt_tokens = d_res.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * CHUNK, f"{prompt_tokens} prompt tokens: fewer than three prefill steps"

    def sent() -> float:
        return transferred(engines)["external_kv_transfer"] - before["external_kv_transfer"]

    wait_for(lambda: sent() >= prompt_tokens, "decode counted the prompt")
    assert sent() == prompt_tokens
    assert transferred(engines)["local_compute"] == before["local_compute"]
    wait_for(lambda: metric(p.url, WRITES) - writes >= 2, lambda: f"P posted {metric(p.url, WRITES) - writes} WRITE(s)")
    assert metric(p.url, PARTIAL) - partial >= 1, "no WRITE without Done: the prompt went in one piece"

    reference = post(p, b, f"ref-{uuid.uuid4().hex}")  # the same request on one plain instance
    assert reference.status_code == 200, reference.text
    assert d_res.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
