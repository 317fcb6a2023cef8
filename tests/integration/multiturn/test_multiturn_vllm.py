"""Multi-turn on push with upstream's NixlPushConnector (real vLLM CPU engines, prefix caching on).

(a) bypass: after turn 1 went through P/D push, turn 2 sent to decode alone is served from decode's own prefix
    cache (turn 1's prompt arrived by transfer and is cached there, its answer was generated there);
(b) partial prefix push: turn 2 pushed to the same decode needs only the blocks decode lacks
    (local_cache_hit + external_kv_transfer == the prompt);
(c) the same through the router with `--decider session-affinity` (once the dispatcher calls the decider); each
    answer is checked against decode's own tokenizer, so the bypass's cached tokens are predicted exactly;
(d) the token ids the decider asks decode for scrub back to exactly what a client that did not ask would get.
Every turn's greedy output equals one plain instance's for the same conversation. The engines are p0 and the decode
of the session's shared `UPSTREAM_PUSH` family (tests/integration/families.py): every prompt is new to them.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from router import protocol
from tests.integration.families import UPSTREAM_PUSH, FamilyPool
from tests.integration.multiturn.mt_support import (
    PushPair,
    block_size,
    chat_body,
    post_chat,
    push_pair,
    push_turn,
    reply_of,
    sources_delta,
)
from tests.integration.support import metric, wait_for
from tests.integration.vllm_support import kv_sources, prompt_text, router

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.family(UPSTREAM_PUSH)]


@pytest.fixture(scope="module")
def engines(family_pool: FamilyPool) -> PushPair:
    return push_pair(family_pool.get(UPSTREAM_PUSH))


def single(pair: PushPair, body: dict[str, object]) -> str:
    """The same request on one plain instance (the prefill engine serving it whole)."""
    return reply_of(post_chat(pair.prefill.url, body)).text


def first_turn(pair: PushPair) -> tuple[list[dict[str, str]], int]:
    """Turn 1 pushed; returns the history a client sends next (its answer appended) and turn 1's prompt tokens."""
    user1 = {"role": "user", "content": prompt_text(50)}
    body = chat_body([user1])
    before = kv_sources(pair.decode.url)
    got = push_turn(pair, body)
    moved = sources_delta(pair.decode.url, before, got.prompt_tokens)
    assert moved["external_kv_transfer"] == got.prompt_tokens, moved  # turn 1 arrived whole by transfer
    assert got.text == single(pair, body)
    return [user1, {"role": "assistant", "content": got.text}], got.prompt_tokens


def test_a_bypassed_turn_two_is_served_from_decodes_prefix_cache(engines: PushPair) -> None:
    history, p1 = first_turn(engines)
    block = block_size(engines.decode.url)
    body = chat_body([*history, {"role": "user", "content": f"And then? ({uuid.uuid4().hex[:8]})"}])
    before = kv_sources(engines.decode.url)
    got = reply_of(post_chat(engines.decode.url, body))  # no kv_transfer_params: decode computes what it lacks
    moved = sources_delta(engines.decode.url, before, got.prompt_tokens)
    assert moved["external_kv_transfer"] == 0
    assert moved["local_cache_hit"] >= (p1 // block) * block, (moved, p1, block)
    assert moved["local_cache_hit"] + moved["local_compute"] == got.prompt_tokens
    assert got.cached_tokens == moved["local_cache_hit"]  # what the decider's prediction is checked against
    assert got.text == single(engines, body)


def test_a_pushed_turn_two_transfers_only_the_blocks_decode_lacks(engines: PushPair) -> None:
    history, p1 = first_turn(engines)
    block = block_size(engines.decode.url)
    body = chat_body([*history, {"role": "user", "content": prompt_text(20)}])
    before = kv_sources(engines.decode.url)
    got = push_turn(engines, body)
    moved = sources_delta(engines.decode.url, before, got.prompt_tokens)
    assert moved["local_cache_hit"] >= (p1 // block) * block, moved
    assert moved["local_cache_hit"] + moved["external_kv_transfer"] == got.prompt_tokens, moved
    assert moved["local_compute"] == 0, moved
    assert got.text == single(engines, body)


def _router_calls_the_decider() -> bool:
    import router.dispatch

    return ".decide(" in Path(router.dispatch.__file__).read_text(encoding="utf-8")


def test_through_the_router_with_the_decider(engines: PushPair, tmp_path: Path) -> None:
    """Turn 2 (short) is bypassed on the decode that holds turn 1; turn 3 (long) is pushed, partially."""
    if not _router_calls_the_decider():
        pytest.skip("the dispatcher does not call the decider yet (interface 5, router helper)")
    d = engines.decode.url
    block = block_size(d)
    headers = {"X-Session-ID": f"mt-{uuid.uuid4().hex}"}
    config = tmp_path / "decider.yaml"
    options = f"  bypass_max_uncached_tokens: 256\n  block_tokens: {block}\n"
    config.write_text(f"decider:\n  name: session-affinity\n{options}", encoding="utf-8")
    with router("push", [engines.prefill_arg()], [d], "--config", str(config)) as url:

        def turn(messages: list[dict[str, str]]) -> tuple[str, int, dict[str, float]]:
            body = chat_body(messages)
            before = kv_sources(d)
            response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            assert response.json()["choices"][0].get("token_ids") is None  # asked for the decider, not shown
            got = reply_of(response)
            assert got.text == single(engines, body)
            return got.text, got.prompt_tokens, sources_delta(d, before, got.prompt_tokens)

        def checked(n: int) -> None:  # the answer checks run after the client has its answer
            wait_for(lambda: metric(url, "kvpush_decider_answers_checked_total") >= n, f"{n} answers checked")

        history = [{"role": "user", "content": prompt_text(50)}]
        answer, p1, moved = turn(history)
        assert moved["external_kv_transfer"] == p1, moved  # turn 1: pushed whole
        checked(1)
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Short follow-up?"}]
        answer, p2, moved = turn(history)
        assert moved["external_kv_transfer"] == 0, moved  # turn 2: bypassed
        assert moved["local_cache_hit"] >= (p1 // block) * block, moved
        predicted = metric(url, "kvpush_bypass_predicted_cached_tokens_total")
        assert predicted == metric(url, "kvpush_bypass_actual_cached_tokens_total") == moved["local_cache_hit"]
        checked(2)
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": prompt_text(60)}]
        _, p3, moved = turn(history)
        assert moved["local_cache_hit"] >= (p2 // block) * block, moved  # turn 3: pushed, only what decode lacks
        assert moved["local_cache_hit"] + moved["external_kv_transfer"] == p3, moved
        assert moved["external_kv_transfer"] > 0, moved


def _same_request(payload: dict[str, object]) -> list[object]:
    """An answer or chunk, less what differs between two requests for the same thing: id, created, and the cached
    tokens (the second one hits the first one's prefix)."""
    payload.pop("id", None), payload.pop("created", None)
    usage = payload.get("usage")
    if isinstance(usage, dict):
        usage.pop("prompt_tokens_details", None)
    return list(payload.items())  # key order too


def _events(data: bytes) -> list[object]:
    """A stream's events as JSON, less what differs between two requests (`_same_request`)."""
    found: list[object] = []
    for event in data.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            found.append(event)
            continue
        found.append(_same_request(json.loads(event[6:])))
    return found


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_the_token_ids_asked_for_the_decider_scrub_back_to_the_plain_answer(
    engines: PushPair, endpoint: str, stream: bool
) -> None:
    """The router's `scrub_token_ids` rests on vLLM writing the fields as null when not asked: pinned here."""
    text = prompt_text(20)
    body: dict[str, object] = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": text}]} if "chat" in endpoint else {"prompt": text}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    plain = httpx.post(f"{engines.prefill.url}{endpoint}", json=body, timeout=120)
    asked = httpx.post(f"{engines.prefill.url}{endpoint}", json=protocol.asking_token_ids(body), timeout=120)
    assert plain.status_code == asked.status_code == 200, (plain.text, asked.text)
    assert b'token_ids":[' in asked.content  # the ids came
    scrubbed = (
        protocol.scrub_token_ids(asked.content)
        if not stream
        else b"".join(protocol.scrub_token_ids(event + b"\n\n") for event in asked.content.split(b"\n\n") if event)
    )
    if stream:
        assert _events(scrubbed) == _events(plain.content)
    else:
        assert _same_request(json.loads(scrubbed)) == _same_request(json.loads(plain.content))
