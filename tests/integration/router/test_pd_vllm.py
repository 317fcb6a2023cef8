"""The router on real vLLM CPU engines with upstream's NIXL connectors, in push and in pull mode.

Each mode's engines (two prefills on core 0, one decode on core 1) start once for this module. The normal
router uses the first prefill; the last test kills the second prefill under a router that uses both.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.vllm_support import (
    Pair,
    complete,
    kv_sources,
    metric,
    pair,
    path_of,
    request_body,
    require_vllm,
    router,
    timing,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlConnector"}
SETTLE = 30.0  # seconds an engine gets to reflect a finished or aborted request in its metrics


@dataclass
class Stack:
    mode: str
    engines: Pair
    router_url: str

    @property
    def decode_url(self) -> str:
        return str(self.engines.decode.url)

    @property
    def prefill_url(self) -> str:
        return str(self.engines.prefills[0].url)


@pytest.fixture(scope="module", params=["push", "pull"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    require_vllm()
    mode = request.param
    with (
        pair(CONNECTORS[mode], n_prefill=2, tag=f"rt-{mode}") as engines,
        router(mode, [engines.prefill_spec(0)], [engines.decode.url]) as url,
    ):
        yield Stack(mode, engines, url)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_output_equals_a_single_instance_and_the_kv_was_transferred(stack: Stack, endpoint: str, stream: bool) -> None:
    body = request_body(endpoint, stream)
    before = kv_sources(stack.decode_url)
    got = complete(stack.router_url, endpoint, body)
    assert got.status == 200, got.text
    assert got.prompt_tokens > 100
    wait_for(
        lambda: (
            kv_sources(stack.decode_url)["external_kv_transfer"] - before["external_kv_transfer"] >= got.prompt_tokens
        ),
        "decode counted the prompt as transferred",
    )
    after = kv_sources(stack.decode_url)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == got.prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    reference = complete(stack.prefill_url, endpoint, body)  # the same request on one plain instance
    assert got.text == reference.text and got.text
    record = timing(stack.router_url, got.headers["x-kvpush-pairing-id"])
    assert record["outcome"] == "ok"
    if stack.mode == "push":
        assert record["decode_sent"] < record["prefill_done"], "push legs must overlap"
    else:
        assert record["prefill_done"] <= record["decode_sent"]


def test_sixteen_concurrent_requests_succeed(stack: Stack) -> None:
    bodies = [request_body("completions" if i % 2 else "chat", stream=i % 3 != 0) for i in range(16)]
    before = kv_sources(stack.decode_url)["external_kv_transfer"]
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(
                lambda ib: complete(stack.router_url, "completions" if ib[0] % 2 else "chat", ib[1]), enumerate(bodies)
            )
        )
    assert [r.status for r in results] == [200] * 16
    assert all(r.text for r in results)
    expected = sum(r.prompt_tokens for r in results if r.prompt_tokens)
    streamed = [r for r in results if r.prompt_tokens]
    assert len(streamed) == 16
    wait_for(
        lambda: kv_sources(stack.decode_url)["external_kv_transfer"] - before >= expected,
        "decode counted every prompt as transferred",
    )
    if stack.mode == "push":
        for r in results:
            record = timing(stack.router_url, r.headers["x-kvpush-pairing-id"])
            assert record["decode_sent"] < record["prefill_done"]


def test_a_client_leaving_mid_stream_stops_the_request_on_decode(stack: Stack) -> None:
    body = request_body("completions", stream=True, max_tokens=1500)
    url = f"{stack.router_url}{path_of('completions')}"
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert got
        wait_for(lambda: metric(stack.decode_url, "vllm:num_requests_running") >= 1, "decode is generating")
    wait_for(lambda: metric(stack.decode_url, "vllm:num_requests_running") == 0, "decode aborted the request")
    assert metric(stack.decode_url, "vllm:num_requests_waiting") == 0
    record = httpx.get(f"{stack.router_url}/debug/timings", timeout=10).json()["requests"][-1]
    assert record["outcome"] == "client_gone"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_official_openai_client_works(stack: Stack, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    prompt = request_body("completions", stream=False)["prompt"]
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    extra = {"ignore_eos": True}
    if stream:
        pieces = [
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body=extra
            )
            if c.choices
        ]
        chat = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            if c.choices
        ]
        assert len(pieces) == 8 and "".join(chat)
    else:
        text = (
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
            .choices[0]
            .text
        )
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body=extra,
        )
        assert text and reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="", max_tokens=4)


def test_a_killed_prefill_fails_fast_or_retries_and_the_router_stays_ready(stack: Stack) -> None:
    """Runs last in each mode: it kills the second prefill engine for good."""
    victim = stack.engines.prefills[1]
    specs = [stack.engines.prefill_spec(0), stack.engines.prefill_spec(1)]
    with router(stack.mode, specs, [stack.decode_url], "--prefill-policy", "round-robin") as url:
        warm = [complete(url, "completions", request_body("completions", True)) for _ in range(2)]
        assert [r.status for r in warm] == [200, 200]
        with ThreadPoolExecutor(6) as pool:
            running = [
                pool.submit(_status_and_error, url, request_body("completions", True, 64), 60.0) for _ in range(6)
            ]
            assert victim.pid is not None
            os.killpg(victim.pid, signal.SIGKILL)
            results = [f.result() for f in running]
        after = [complete(url, "chat", request_body("chat", i % 2 == 0), 60.0) for i in range(4)]
        for status, message in results:
            assert status in (200, 502, 503, 504), message
            if status != 200:  # the failure is the prefill's, and the client is told so (not which URL)
                assert "prefill" in message and "http://" not in message, message
        assert [r.status for r in after] == [200] * 4, "the router must route around the dead prefill"
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 200
        states = {w["url"]: w["healthy"] for w in ready.json()["workers"]}
        assert states[str(victim.url)] is False
    wait_for(lambda: metric(stack.decode_url, "vllm:num_requests_running") == 0, "decode has nothing stuck")


def _status_and_error(url: str, body: dict[str, Any], timeout: float) -> tuple[int, str]:
    """A streamed completion read to its end: its status and, when it failed, the error message it carried."""
    with httpx.Client(timeout=timeout) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, str(json.loads(r.read())["error"]["message"])
        errors = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith('data: {"error"')]
        return 200, str(errors[0]["error"]["message"]) if errors else ""
