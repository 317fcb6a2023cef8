"""Two router replicas in front of one P/D family whose engines publish their KV events (issue 24).

The session's shared push family (`UPSTREAM_PUSH`, tests/integration/families.py: vLLM's NixlPushConnector,
prefills on core 0, a decode on core 1), every engine publishing on its HTTP port + `stack.engines.KV_EVENT_OFFSETS`
and started with VLLM_SERVER_DEV_MODE (POST /reset_prefix_cache); two routers over p0 and the decode, each with the
session-affinity decider and `kv_events` on the same offsets. Neither router sees the other's requests: what they
share is what the engines say they hold. Other modules run on the same engines, so each test starts from a reset
decode prefix cache that both replicas have seen emptied.

(a) A conversation whose turns alternate replicas: turn 2, sent to the replica that never saw turn 1, is bypassed
    and served from decode's own prefix cache, as it is with one replica.
(b) Decode's prefix cache reset (AllBlocksCleared) reaches both replicas' views; the replica whose own index still
    credits decode with the conversation pushes the next turn instead of bypassing it.

(c) The subscriber itself, in this process, against the decode engine: a prompt's blocks appear block by block
    with the prompt's own token ids, so `held_prefix` finds the whole prompt there, counted for the request's
    X-Session-ID (vLLM tags each stored block with it).
(d) Last, as it restarts the decode engine: its exit empties both replicas' views of it (the publisher's
    connection dropped), and once it is back the conversation it held is pushed, not bypassed, on either replica.
    (How soon the views empty is a figure of the multiturn suite's replicas run, not asserted here.)

Every wait is on state (the engines' counters, the routers' /metrics), never on time.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from router.kv_events.endpoints import endpoints_near
from router.kv_events.frames import Layout
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber
from router.kv_events.view import KvEventView
from stack.engines import KV_EVENT_OFFSETS, Engine, Fleet
from tests.integration.families import UPSTREAM_PUSH, Family, FamilyPool
from tests.integration.support import LOGS, STARTUP_TIMEOUT, VLLM, metric, wait_for
from tests.integration.vllm_support import kv_sources, prompt_text, push_replicas

pytestmark = [*VLLM, pytest.mark.family(UPSTREAM_PUSH)]
PROMPT = [300 + (i * 7) % 1500 for i in range(300)]  # token ids of the tiny model's vocabulary (2048)


@dataclass
class Bed:
    prefill: Engine
    decode: Engine
    replicas: tuple[str, str]  # the two routers' base URLs
    block: int  # the engines' KV block size
    family: Family  # the shared family (an engine restarted in place goes in family.engines, under its fleet)


def _block_size(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'block_size="' in line:
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise AssertionError("vllm:cache_config_info has no block_size")


@pytest.fixture(scope="module")
def bed(family_pool: FamilyPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    family = family_pool.get(UPSTREAM_PUSH)
    assert family.spec.kv_events and ("VLLM_SERVER_DEV_MODE", "1") in family.spec.env, family.spec
    prefill, decode = family.engines.prefills[0], family.engines.decode
    block = _block_size(decode.url)
    config = tmp_path_factory.mktemp("kv-replicas") / "router.yaml"
    offset, replay = KV_EVENT_OFFSETS
    config.write_text(
        "decider:\n  name: session-affinity\n  bypass_max_uncached_tokens: 256\n"
        f"  block_tokens: {block}\n"
        f"kv_events:\n  port_offset: {offset}\n  replay_offset: {replay}\n",
        encoding="utf-8",
    )
    with Fleet(LOGS) as routers:
        urls = push_replicas(routers, prefill, decode, config, "kv-replica")
        yield Bed(prefill, decode, (urls[0], urls[1]), block, family)


@pytest.fixture
def clean(bed: Bed) -> Bed:
    """The bed with decode's prefix cache reset and both replicas' views of decode caught up and empty (what
    other tests on the shared family, or this module's, left there is gone)."""
    _reset_prefix_cache(bed)
    return bed


def _reset_prefix_cache(bed: Bed) -> None:
    httpx.post(f"{bed.decode.url}/reset_prefix_cache", timeout=30).raise_for_status()
    # vLLM publishes what a scheduler step collected: an idle engine's reset goes out with its next step (a busy
    # engine's at once); a prompt shorter than a block steps it without storing a block
    poke = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    httpx.post(f"{bed.decode.url}/v1/completions", json=poke, timeout=60).raise_for_status()
    for router in bed.replicas:
        wait_for(partial(_empty, router, bed.decode.url), partial(_debug, router))


def _caught_up(router: str, worker: str) -> bool:
    return metric(router, "kvpush_kv_events_caught_up", worker=worker) == 1


def _held(router: str, worker: str) -> float:
    return metric(router, "kvpush_kv_events_held_blocks", worker=worker)


def _holds(router: str, worker: str, blocks: int) -> bool:
    return _caught_up(router, worker) and _held(router, worker) >= blocks


def _empty(router: str, worker: str) -> bool:
    return _caught_up(router, worker) and _held(router, worker) == 0


def _debug(router: str) -> str:
    text = httpx.get(f"{router}/metrics", timeout=10).text
    seen = "; ".join(line for line in text.splitlines() if line.startswith("kvpush_kv_events"))
    return f"{router} saw decode's cache emptied ({seen})"


@dataclass
class Turn:
    text: str
    prompt_tokens: int
    moved: dict[str, float]  # decode's prompt tokens by source for this turn


def _turn(bed: Bed, router: str, messages: list[dict[str, str]], session: str) -> Turn:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}
    body["ignore_eos"] = True
    before = kv_sources(bed.decode.url)
    answer = httpx.post(f"{router}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=120)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    prompt = int(data["usage"]["prompt_tokens"])

    def moved() -> dict[str, float]:
        after = kv_sources(bed.decode.url)
        return {k: after[k] - before[k] for k in after}

    wait_for(lambda: sum(moved().values()) >= prompt, "decode counted the turn's prompt tokens by source")
    return Turn(data["choices"][0]["message"]["content"], prompt, moved())


def _decode_holds(bed: Bed, tokens: int) -> None:
    """Both replicas' views of decode are caught up and hold at least `tokens` worth of whole blocks (a view is
    caught up from the engine's first message on: an idle engine has said nothing yet)."""
    want = tokens // bed.block
    for router in bed.replicas:
        what = f"{router} caught up with decode, {want} blocks held"
        wait_for(partial(_holds, router, bed.decode.url, want), what)


def test_turns_alternating_replicas_still_bypass_on_the_decode_that_holds_the_conversation(clean: Bed) -> None:
    bed = clean
    a, b = bed.replicas
    session = f"kvr-{uuid.uuid4().hex}"
    history = [{"role": "user", "content": prompt_text(50)}]
    first = _turn(bed, a, history, session)
    assert first.moved["external_kv_transfer"] == first.prompt_tokens, first.moved  # turn 1: pushed whole
    _decode_holds(bed, first.prompt_tokens)
    bypassed = metric(b, "kvpush_decisions_total", route="bypass")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Short follow-up?"}]
    second = _turn(bed, b, history, session)  # the replica that never saw turn 1
    assert second.moved["external_kv_transfer"] == 0, second.moved  # bypassed: no prefill leg, no transfer
    assert second.moved["local_cache_hit"] >= (first.prompt_tokens // bed.block) * bed.block, second.moved
    assert metric(b, "kvpush_decisions_total", route="bypass") == bypassed + 1
    assert metric(b, "kvpush_decider_event_matches_total") >= 1  # only the events knew decode held it
    _decode_holds(bed, second.prompt_tokens)
    history += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "And then?"}]
    third = _turn(bed, a, history, session)  # back on the first replica: its own index lags a turn
    assert third.moved["external_kv_transfer"] == 0, third.moved
    assert third.moved["local_cache_hit"] >= (second.prompt_tokens // bed.block) * bed.block, third.moved


def test_a_reset_prefix_cache_reaches_both_replicas_and_stops_the_bypass(clean: Bed) -> None:
    bed = clean
    a = bed.replicas[0]
    session = f"kvr-{uuid.uuid4().hex}"
    history = [{"role": "user", "content": prompt_text(50)}]
    first = _turn(bed, a, history, session)
    _decode_holds(bed, first.prompt_tokens)
    _reset_prefix_cache(bed)
    corrected = metric(a, "kvpush_decider_event_corrections_total")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Short follow-up?"}]
    second = _turn(bed, a, history, session)  # a's own index still says decode holds turn 1
    assert second.moved["external_kv_transfer"] > 0, second.moved  # pushed: decode no longer held the prefix
    assert second.moved["local_cache_hit"] == 0, second.moved
    assert metric(a, "kvpush_decider_event_corrections_total") == corrected + 1


async def test_a_prompts_and_its_answers_blocks_appear_with_their_token_ids(bed: Bed) -> None:
    decode = bed.decode.engine_spec
    offset, replay = KV_EVENT_OFFSETS
    port = decode.http_port
    (endpoint,) = endpoints_near("e0", decode.url, port + offset, port + replay)
    session = f"kv-events-{uuid.uuid4().hex[:8]}"
    subscriber = KvEventSubscriber(KvIndex(100_000))
    view = KvEventView(subscriber.index, subscriber.status)
    subscriber.add([endpoint])
    task = asyncio.create_task(subscriber.run())
    try:
        block = _block_size(decode.url)
        async with httpx.AsyncClient(base_url=decode.url, timeout=120.0) as client:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": block + 8, "min_tokens": block + 8}
            body |= {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
            answer = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
            assert answer.status_code == 200, answer.text
        generated = answer.json()["choices"][0]["token_ids"]
        computed = [*PROMPT, *generated[:-1]]  # the last generated id was sampled, never computed
        stream = subscriber.index.stream("e0", 0)
        deadline = time.monotonic() + 30  # a bound for a failure's message, not a timed assertion
        while (view.session_tokens(session).get("e0", 0)) < len(computed) // block * block:
            assert time.monotonic() < deadline, f"the session's blocks did not arrive: {view.status('e0')}"
            await asyncio.sleep(0.05)
        assert stream.block_size == block
        tail = view.session_tail("e0", session)  # the tip: the blocks its prompt and its answer filled, in order
        assert tail is not None and tail.end == len(computed) // block * block
        assert list(tail.tokens) == computed[tail.start : tail.end]
        whole = len(PROMPT) // stream.block_size
        held = view.held_prefix("e0", PROMPT)
        assert (held.blocks, held.tokens, held.rank) == (whole, whole * stream.block_size, 0)
        assert view.held_prefix("e0", [PROMPT[0] + 1, *PROMPT[1:]]).blocks == 0  # another first token: nothing
        assert view.caught_up("e0"), view.status("e0")  # joined late: replayed from 0
        assert view.session_holders(session).get("e0", 0) >= whole  # the engine tagged them with the session
        assert view.session_tokens(session).get("e0", 0) >= whole * stream.block_size
        assert subscriber.frames.layouts.get(Layout.ARRAY_MAP.value, 0) >= 1
        assert (subscriber.frames.malformed, subscriber.frames.oversized, subscriber.sequence.holes) == (0, 0, 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()


def _views_dropped(router: str, worker: str) -> bool:
    return _held(router, worker) == 0


def test_a_restarted_decode_is_dropped_from_both_views_and_its_conversation_is_pushed(bed: Bed) -> None:
    a, b = bed.replicas
    session = f"kvr-{uuid.uuid4().hex}"
    history = [{"role": "user", "content": prompt_text(50)}]
    first = _turn(bed, a, history, session)
    _decode_holds(bed, first.prompt_tokens)
    bed.decode.stop()
    for router in bed.replicas:
        wait_for(partial(_views_dropped, router, bed.decode.url), partial(_debug, router))
    restarts = [metric(r, "kvpush_kv_events_sequence_total", kind="restarts") for r in bed.replicas]
    assert all(n >= 1 for n in restarts), restarts
    engines = bed.family.engines
    env = {**os.environ, **dict(bed.family.spec.env)}
    bed.decode = engines.decode = engines.fleet.start(Engine(bed.decode.engine_spec, log_dir=LOGS, base_env=env))
    bed.decode.wait_healthy(STARTUP_TIMEOUT)
    for router in bed.replicas:
        wait_for(partial(_healthy, router, bed.decode.url), f"{router} sees the decode back")
    bypassed = [metric(r, "kvpush_decisions_total", route="bypass") for r in bed.replicas]
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Short follow-up?"}]
    second = _turn(bed, b, history, session)
    assert second.moved["external_kv_transfer"] > 0 and second.moved["local_cache_hit"] == 0, second.moved
    history += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "And then?"}]
    _decode_holds(bed, second.prompt_tokens)
    third = _turn(bed, a, history, session)  # a served turn 1 on the engine before its restart
    assert third.moved["external_kv_transfer"] == 0, third.moved  # bypassed on what the new engine holds
    assert third.moved["local_cache_hit"] >= (second.prompt_tokens // bed.block) * bed.block, third.moved
    assert [metric(r, "kvpush_decisions_total", route="bypass") for r in bed.replicas] == [bypassed[0] + 1, bypassed[1]]


def _healthy(router: str, worker: str) -> bool:
    return metric(router, "kvpush_worker_healthy", worker=worker) == 1
