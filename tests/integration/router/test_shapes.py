"""Request shapes and usage through the router on real vLLM CPU engines (issue 39): the cached-token count a client
bills by is what the serving engine really found in its prefix cache, in push (our connector), pull (upstream's
NixlConnector) and on a bypass; the shapes vLLM computes on decode anyway go decode-only; refused shapes reach no
engine.

Runs on test_pd_e2e's families (same specs, so no extra start: conftest groups the modules of one family) with
routers of its own over p0 and the decode. Prompts are uuid-led, counters are read as deltas.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.families import FamilyPool
from tests.integration.support import VLLM, wait_for
from tests.integration.test_pd_e2e import CONNECTORS, Connector
from tests.integration.vllm_support import (
    Engines,
    kv_sources,
    path_of,
    prompt_text,
    request_body,
    router,
    timing,
)

pytestmark = VLLM
SHAPED = [c for c in CONNECTORS if c.id in ("kvpush-push", "upstream-pull")]
PARAMS = [pytest.param(c, id=c.id, marks=pytest.mark.family(c.family)) for c in SHAPED]
SUFFIX = "\ndef tail(y): return y + 1\n"


@dataclass
class Bed:
    """A family's engines and a router in the connector's mode over p0 and the decode (this module's, Messages' and
    Responses' beds)."""

    connector: Connector
    engines: Engines
    router_url: str

    @property
    def p0_url(self) -> str:
        return self.engines.prefills[0].url

    @property
    def decode_url(self) -> str:
        return self.engines.decode.url


@dataclass
class Shapes(Bed):
    sticky_url: str  # the router_url's legs with the session-affinity decider (bypasses to the decode holding a prefix)


@pytest.fixture(scope="module", params=PARAMS)
def shapes(request: pytest.FixtureRequest, family_pool: FamilyPool) -> Iterator[Shapes]:
    c: Connector = request.param
    engines = family_pool.get(c.family).engines
    p0, d = engines.prefills[0].engine_spec.prefill_arg(), engines.decode.url
    with contextlib.ExitStack() as running:
        url = running.enter_context(router(c.mode, [p0], [d]))
        sticky = running.enter_context(router(c.mode, [p0], [d], "--decider", "session-affinity"))
        yield Shapes(c, engines, url, sticky)


@dataclass
class Answer:
    status: int
    body: dict[str, Any]  # the JSON answer, or the stream's last usage as {"usage": ...}
    headers: httpx.Headers

    @property
    def usage(self) -> dict[str, Any]:
        found: dict[str, Any] = self.body["usage"]
        return found


def ask(
    base_url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None, endpoint: str = "completions"
) -> Answer:
    """One request; a stream's events are read and its last usage kept."""
    url = f"{base_url}{path_of(endpoint)}"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body, headers=headers) as response:
        if not body.get("stream") or response.status_code != 200:
            return Answer(response.status_code, json.loads(response.read()), response.headers)
        usage = None
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return Answer(200, {"usage": usage}, response.headers)


def completion(prompt: str, stream: bool, max_tokens: int = 4) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def prompt_seen(url: str, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """The engine's prompt-token counters once it has counted the whole prompt since `before`, as deltas."""

    def delta() -> dict[str, float]:
        now = kv_sources(url)
        return {source: now[source] - before[source] for source in now}

    wait_for(lambda: sum(delta().values()) >= prompt_tokens, f"{url} counted the prompt")
    return delta()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_cached_tokens_are_exactly_the_prefills_partial_prefix_hit(shapes: Shapes, stream: bool) -> None:
    head = prompt_text(24)
    warm = ask(shapes.router_url, completion(head, stream=False))
    assert warm.status == 200, warm.body
    before = kv_sources(shapes.p0_url)
    got = ask(shapes.router_url, completion(head + SUFFIX, stream))
    assert got.status == 200, got.body
    prompt = got.usage["prompt_tokens"]
    on_p = prompt_seen(shapes.p0_url, before, prompt)
    assert on_p["external_kv_transfer"] == 0
    assert 0 < on_p["local_cache_hit"] < prompt  # a partial hit: the head's whole blocks
    assert got.usage["prompt_tokens_details"]["cached_tokens"] == on_p["local_cache_hit"]


def test_a_bypass_reports_the_decodes_own_partial_hit(shapes: Shapes) -> None:
    session = {"x-session-id": f"s-{uuid.uuid4().hex}"}
    head = prompt_text(24)
    first = ask(shapes.sticky_url, completion(head, stream=False), session)
    assert first.status == 200, first.body
    before = kv_sources(shapes.decode_url)
    got = ask(shapes.sticky_url, completion(head + SUFFIX, stream=True), session)
    assert got.status == 200, got.body
    assert timing(shapes.sticky_url, got.headers["x-kvpush-pairing-id"])["mode"] == "bypass"
    prompt = got.usage["prompt_tokens"]
    on_d = prompt_seen(shapes.decode_url, before, prompt)
    assert on_d["external_kv_transfer"] == 0
    assert 0 < on_d["local_cache_hit"] < prompt
    assert got.usage["prompt_tokens_details"]["cached_tokens"] == on_d["local_cache_hit"]


@pytest.mark.parametrize(("field", "param"), [({"best_of": 2}, "best_of"), ({"n": 0}, "n"), ({"n": 2.5}, "n")])
def test_a_refused_shape_reaches_no_engine(shapes: Shapes, field: dict[str, Any], param: str) -> None:
    before = [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]
    got = ask(shapes.router_url, {**completion(prompt_text(4), stream=False), **field})
    assert got.status == 400 and got.body["error"]["type"] == "invalid_request_error"
    assert got.body["error"]["param"] == param
    assert before == [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]


def test_prompt_logprobs_go_decode_only_and_answer_as_the_decode_alone(shapes: Shapes) -> None:
    body = {**completion(prompt_text(2), stream=False), "prompt_logprobs": 1}
    before = kv_sources(shapes.p0_url)
    got = ask(shapes.router_url, body)
    assert got.status == 200, got.body
    assert timing(shapes.router_url, got.headers["x-kvpush-pairing-id"])["mode"] == "bypass"
    assert kv_sources(shapes.p0_url) == before
    alone = ask(shapes.decode_url, body)
    assert got.body["choices"][0]["text"] == alone.body["choices"][0]["text"]
    assert got.body["choices"][0]["prompt_logprobs"] == alone.body["choices"][0]["prompt_logprobs"]


@dataclass
class Choices:
    texts: dict[int, str]  # choice index -> its text
    usage: dict[str, Any]


def choices(base_url: str, endpoint: str, body: dict[str, Any]) -> Choices:
    """Every choice's text of one request, streamed (joined per index) or not."""
    got = ask(base_url, body, endpoint=endpoint) if not body.get("stream") else None
    if got is not None:
        assert got.status == 200, got.body
        key = "text" if endpoint == "completions" else "message"
        picked = {c["index"]: c[key] if key == "text" else c[key]["content"] for c in got.body["choices"]}
        return Choices(picked, got.usage)
    texts: dict[int, str] = {}
    usage: dict[str, Any] = {}
    url = f"{base_url}{path_of(endpoint)}"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event["choices"]:
                piece = c.get("text") if endpoint == "completions" else (c.get("delta") or {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return Choices(texts, usage)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_equal_a_single_instance_and_the_prompt_moves_once(
    shapes: Shapes, endpoint: str, stream: bool
) -> None:
    body = {**request_body(endpoint, stream, max_tokens=6), "n": 3, "temperature": 0.8, "seed": 7}
    before, before_p = kv_sources(shapes.decode_url), kv_sources(shapes.p0_url)
    got = choices(shapes.router_url, endpoint, body)
    prompt = got.usage["prompt_tokens"]
    assert sum(prompt_seen(shapes.p0_url, before_p, prompt).values()) == prompt  # P computed it once
    on_d = prompt_seen(shapes.decode_url, before, 4 * prompt)  # the one-token pair's prompt, then 3 children's
    assert on_d["external_kv_transfer"] == prompt  # moved once, not once per choice
    assert on_d["local_compute"] < prompt  # the choices started from decode's prefix cache
    assert got.usage["completion_tokens"] == 3 * 6
    reference = choices(shapes.p0_url, endpoint, body)
    assert sorted(got.texts) == [0, 1, 2]
    assert got.texts == reference.texts
    assert len(set(got.texts.values())) > 1  # the children's seeds differ (seed + i)


def test_greedy_n_choices_are_refused_before_any_engine(shapes: Shapes) -> None:
    before = [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]
    got = ask(shapes.router_url, {**completion(prompt_text(4), stream=False), "n": 2})
    assert got.status == 400 and got.body["error"]["param"] == "n"
    assert before == [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_batch_equals_a_single_instance_and_moves_each_prompt_once(shapes: Shapes, stream: bool) -> None:
    prompts = [prompt_text(words) for words in (20, 8, 14)]
    body = {**completion("", stream, max_tokens=5), "prompt": prompts}
    before = kv_sources(shapes.decode_url)
    got = choices(shapes.router_url, "completions", body)
    prompt = got.usage["prompt_tokens"]
    on_d = prompt_seen(shapes.decode_url, before, prompt)
    assert on_d["external_kv_transfer"] == prompt  # every prompt's KV moved, each once
    assert on_d["local_compute"] == 0
    assert got.usage["completion_tokens"] == 3 * 5
    reference = choices(shapes.p0_url, "completions", body)  # one instance merges the batch itself
    assert got.texts == reference.texts and sorted(got.texts) == [0, 1, 2]
    assert prompt == reference.usage["prompt_tokens"]


def test_a_batch_with_a_bad_prompt_reaches_no_engine(shapes: Shapes) -> None:
    before = [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]
    got = ask(shapes.router_url, {**completion("", stream=False), "prompt": [prompt_text(4), ""]})
    assert got.status == 400 and got.body["error"]["param"] == "prompt"
    assert before == [kv_sources(url) for url in (shapes.p0_url, shapes.decode_url)]


def test_tokenize_detokenize_and_version_are_a_workers_own_answers(shapes: Shapes) -> None:
    text = {"model": "tiny", "prompt": prompt_text(3)}
    via, alone = (
        httpx.post(f"{url}/tokenize", json=text, timeout=30) for url in (shapes.router_url, shapes.decode_url)
    )
    assert via.status_code == 200 and via.json() == alone.json()
    ids = {"model": "tiny", "tokens": via.json()["tokens"]}
    back, back_alone = (
        httpx.post(f"{url}/detokenize", json=ids, timeout=30) for url in (shapes.router_url, shapes.decode_url)
    )
    assert back.status_code == 200 and back.json() == back_alone.json()
    assert back.json()["prompt"].endswith(text["prompt"])  # after the tokenizer's BOS
    version = httpx.get(f"{shapes.router_url}/version", timeout=30)
    assert version.status_code == 200 and version.json() == httpx.get(f"{shapes.decode_url}/version").json()
