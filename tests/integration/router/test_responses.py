"""OpenAI's Responses API through the router on real vLLM CPU engines (issue 39).

- A first turn, streamed and not, through push (our connector) and pull (upstream's NixlConnector): its greedy text
  equals the decode engine asked directly, the prompt moves once, P stores nothing, the cached count a client
  bills by is what P really found, and a stream's events come 1:1 (sequence numbers 0..k, created first,
  completed last).
- State (push, on engines started with VLLM_ENABLE_RESPONSES_API_STORE=1): the id the router answers names the
  decode that holds it; a follow-up by `previous_response_id` goes to that decode alone and answers as the same
  two turns on the decode alone; `GET /v1/responses/{id}` is that decode's stored response.
- Refusals (background, a built-in tool, a forged id) reach no engine.

The pull bed is test_shapes' family (no extra start); the stored-state bed is the push family with the store's
environment variable added (one start of its own: vLLM reads it at start-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.families import FamilyPool, FamilySpec
from tests.integration.router.test_shapes import SHAPED, SUFFIX, prompt_seen
from tests.integration.router.test_shapes import Bed as ShapesBed
from tests.integration.support import VLLM
from tests.integration.test_pd_e2e import Connector
from tests.integration.vllm_support import kv_sources, prompt_text, router, timing

pytestmark = VLLM
STORE = ("VLLM_ENABLE_RESPONSES_API_STORE", "1")


def family_of(c: Connector) -> FamilySpec:
    """Push beds keep state (the store's variable added); the pull bed is the shared family as it is."""
    base = c.family
    return dataclasses.replace(base, env=(*base.env, STORE)) if c.mode == "push" else base


PARAMS = [pytest.param(c, id=c.id, marks=pytest.mark.family(family_of(c))) for c in SHAPED]


class Bed(ShapesBed):
    """The shapes' bed, and whether its engines keep Responses state."""

    @property
    def stores(self) -> bool:
        return STORE in family_of(self.connector).env


@pytest.fixture(scope="module", params=PARAMS)
def bed(request: pytest.FixtureRequest, family_pool: FamilyPool) -> Iterator[Bed]:
    c: Connector = request.param
    engines = family_pool.get(family_of(c)).engines
    with contextlib.ExitStack() as running:
        url = running.enter_context(
            router(c.mode, [engines.prefills[0].engine_spec.prefill_arg()], [engines.decode.url])
        )
        yield Bed(c, engines, url)


@dataclass
class Said:
    status: int
    body: dict[str, Any]  # the response (a stream's from response.completed), or the error body
    events: list[dict[str, Any]]  # a stream's events in order
    headers: httpx.Headers

    @property
    def text(self) -> str:
        return "".join(
            part.get("text", "")
            for item in self.body.get("output", [])
            if item.get("type") == "message"
            for part in item.get("content", [])
        )

    @property
    def cached(self) -> int:
        found: int = self.body["usage"]["input_tokens_details"]["cached_tokens"]
        return found


def ask(base_url: str, body: dict[str, Any]) -> Said:
    url = f"{base_url}/v1/responses"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as response:
        if not body.get("stream") or response.status_code != 200:
            return Said(response.status_code, json.loads(response.read()), [], response.headers)
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        done = events[-1].get("response", {}) if events else {}
        return Said(200, done, events, response.headers)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    """The event types in order, a run of one type counted once."""
    return [e["type"] for i, e in enumerate(events) if i == 0 or events[i - 1]["type"] != e["type"]]


def turn(text: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": text, "max_output_tokens": 8, "temperature": 0, "stream": stream, **extra}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_first_turn_equals_the_decode_alone_and_moves_the_prompt_once(bed: Bed, stream: bool) -> None:
    body = turn(prompt_text(30), stream, store=False)
    before, before_p = kv_sources(bed.decode_url), kv_sources(bed.p0_url)
    got = ask(bed.router_url, body)
    assert got.status == 200, got.body
    assert timing(bed.router_url, got.headers["x-kvpush-pairing-id"])["mode"] == bed.connector.mode
    prompt = got.body["usage"]["input_tokens"]
    assert sum(prompt_seen(bed.p0_url, before_p, prompt).values()) == prompt  # P computed it once
    on_d = prompt_seen(bed.decode_url, before, prompt)
    assert on_d["external_kv_transfer"] == prompt and on_d["local_compute"] == 0
    alone = ask(bed.decode_url, body)
    assert got.text == alone.text and got.text
    assert got.body["usage"]["output_tokens"] == alone.body["usage"]["output_tokens"]
    if stream:
        assert [e["sequence_number"] for e in got.events] == list(range(len(got.events)))
        assert [e["type"] for e in got.events][:2] == ["response.created", "response.in_progress"]
        assert got.events[-1]["type"] == "response.completed"
        assert kinds(got.events) == kinds(ask(bed.decode_url, body).events)  # how many deltas: the engine's steps


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_the_cached_count_is_exactly_the_prefills_partial_prefix_hit(bed: Bed, stream: bool) -> None:
    head = prompt_text(24)
    warm = ask(bed.router_url, turn(head, store=False))
    assert warm.status == 200, warm.body
    before = kv_sources(bed.p0_url)
    got = ask(bed.router_url, turn(head + SUFFIX, stream, store=False))
    assert got.status == 200, got.body
    prompt = got.body["usage"]["input_tokens"]
    on_p = prompt_seen(bed.p0_url, before, prompt)
    assert on_p["external_kv_transfer"] == 0
    assert 0 < on_p["local_cache_hit"] < prompt
    assert got.cached == on_p["local_cache_hit"]


def test_a_follow_up_goes_to_the_decode_that_holds_the_first_turn(bed: Bed) -> None:
    if not bed.stores:
        pytest.skip("the pull bed's engines keep no state (the shared family runs without the store)")
    first_text, second_text = prompt_text(20), "and then?"
    first = ask(bed.router_url, turn(first_text))
    assert first.status == 200, first.body
    before_p, before_d = kv_sources(bed.p0_url), kv_sources(bed.decode_url)
    second = ask(bed.router_url, turn(second_text, previous_response_id=first.body["id"]))
    assert second.status == 200, second.body
    assert timing(bed.router_url, second.headers["x-kvpush-pairing-id"])["mode"] == "bypass"
    on_d = prompt_seen(bed.decode_url, before_d, second.body["usage"]["input_tokens"])
    assert on_d["external_kv_transfer"] == 0 and on_d["local_cache_hit"] > 0  # the first turn, from its cache
    assert kv_sources(bed.p0_url) == before_p
    assert second.cached == on_d["local_cache_hit"]  # a bypass: decode's own count
    alone_first = ask(bed.decode_url, turn(first_text))
    alone = ask(bed.decode_url, turn(second_text, previous_response_id=alone_first.body["id"]))
    assert second.text == alone.text and first.text == alone_first.text
    stored = httpx.get(f"{bed.router_url}/v1/responses/{first.body['id']}", timeout=30)
    assert stored.status_code == 200 and stored.json()["id"] == first.body["id"]
    assert stored.json()["output"] == first.body["output"]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"background": True}, 400, "background"),
        ({"tools": [{"type": "web_search_preview"}]}, 400, "tools"),
        ({"previous_response_id": "resp_0123456789abcdef_" + "0" * 32}, 404, "previous_response_id"),
    ],
    ids=["background", "built-in-tool", "forged-id"],
)
def test_what_pd_cannot_serve_reaches_no_engine(bed: Bed, extra: dict[str, Any], status: int, param: str) -> None:
    before = [kv_sources(url) for url in (bed.p0_url, bed.decode_url)]
    got = ask(bed.router_url, turn(prompt_text(4), **extra))
    assert got.status == status and got.body["error"]["param"] == param
    assert before == [kv_sources(url) for url in (bed.p0_url, bed.decode_url)]
