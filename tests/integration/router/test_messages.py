"""Anthropic's Messages API through the router on real vLLM CPU engines (issue 39): greedy answers equal the decode
engine asked directly, streamed and not, through push (our connector) and pull (upstream's NixlConnector); the
cache read a client bills by is what P really found in its prefix cache; a bad request gets Anthropic's 400 and
reaches no engine.

Runs on test_shapes' families (same specs: no extra start) with routers of its own over p0 and the decode.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.families import FamilyPool
from tests.integration.router.test_shapes import PARAMS, SUFFIX, Bed, prompt_seen
from tests.integration.support import VLLM
from tests.integration.test_pd_e2e import Connector
from tests.integration.vllm_support import kv_sources, prompt_text, router, timing

pytestmark = VLLM


@pytest.fixture(scope="module", params=PARAMS)
def bed(request: pytest.FixtureRequest, family_pool: FamilyPool) -> Iterator[Bed]:
    c: Connector = request.param
    engines = family_pool.get(c.family).engines
    with contextlib.ExitStack() as running:
        url = running.enter_context(
            router(c.mode, [engines.prefills[0].engine_spec.prefill_arg()], [engines.decode.url])
        )
        yield Bed(c, engines, url)


@dataclass
class Said:
    status: int
    text: str
    usages: list[dict[str, Any]]  # the JSON answer's usage, or each event's that carried one (start, delta)
    body: dict[str, Any]  # the JSON answer (or error), {} for a stream
    headers: httpx.Headers


def ask(base_url: str, body: dict[str, Any]) -> Said:
    url = f"{base_url}/v1/messages"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as response:
        if not body.get("stream") or response.status_code != 200:
            answer = json.loads(response.read())
            text = "".join(b.get("text", "") for b in answer.get("content", []))
            return Said(response.status_code, text, [answer.get("usage", {})], answer, response.headers)
        text, usages = "", []
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or (event.get("message") or {}).get("usage")
            if usage:
                usages.append(usage)
            text += (event.get("delta") or {}).get("text", "") if event["type"] == "content_block_delta" else ""
        return Said(200, text, usages, {}, response.headers)


def message(text: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    return {**body, "stream": True} if stream else body


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_message_equals_the_decode_alone_and_moves_the_prompt_once(bed: Bed, stream: bool) -> None:
    body = message(prompt_text(30), stream)
    before = kv_sources(bed.decode_url)
    got = ask(bed.router_url, body)
    assert got.status == 200, got.body
    assert timing(bed.router_url, got.headers["x-kvpush-pairing-id"])["mode"] == bed.connector.mode
    prompt = got.usages[-1]["input_tokens"] + got.usages[-1].get("cache_read_input_tokens", 0)
    on_d = prompt_seen(bed.decode_url, before, prompt)
    assert on_d["external_kv_transfer"] == prompt and on_d["local_compute"] == 0  # the prompt came from P, once
    alone = ask(bed.decode_url, body)
    assert got.text == alone.text and got.text
    assert got.usages[-1]["output_tokens"] == alone.usages[-1]["output_tokens"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_cache_read_is_exactly_the_prefills_partial_prefix_hit(bed: Bed, stream: bool) -> None:
    head = prompt_text(24)
    warm = ask(bed.router_url, message(head, stream=False, max_tokens=2))
    assert warm.status == 200, warm.body
    before = kv_sources(bed.p0_url)
    got = ask(bed.router_url, message(head + SUFFIX, stream))
    assert got.status == 200, got.body
    final = got.usages[-1]
    prompt = final["input_tokens"] + final["cache_read_input_tokens"]
    on_p = prompt_seen(bed.p0_url, before, prompt)
    assert on_p["external_kv_transfer"] == 0
    assert 0 < on_p["local_cache_hit"] < prompt  # a partial hit: the head's whole blocks
    assert all(u["cache_read_input_tokens"] == on_p["local_cache_hit"] for u in got.usages)
    assert final["input_tokens"] == prompt - on_p["local_cache_hit"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        {**message("x", False), "kv_transfer_params": {"do_remote_decode": True}},
        {**message("x", False), "messages": []},
    ],
    ids=["no-max-tokens", "kv-params", "no-messages"],
)
def test_a_bad_message_gets_anthropics_400_and_reaches_no_engine(bed: Bed, body: dict[str, Any]) -> None:
    before = [kv_sources(url) for url in (bed.p0_url, bed.decode_url)]
    got = ask(bed.router_url, body)
    assert got.status == 400 and got.body["type"] == "error"
    assert got.body["error"]["type"] == "invalid_request_error"
    assert before == [kv_sources(url) for url in (bed.p0_url, bed.decode_url)]
