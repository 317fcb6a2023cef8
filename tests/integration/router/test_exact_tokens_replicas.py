"""Issue 40's scenario on real engines: two router replicas deciding on exact prompt ids (the `tokenizer` option)
and the same engines' KV events, chat conversations whose turns alternate replicas in both orders, sessions
sharing a system prompt.

The shared push family's p0 and decode (tests/integration/families.py, `UPSTREAM_PUSH`: KV events on); two
routers with the session-affinity decider, the tiny model's tokenizer folder and `kv_events`. Neither router sees
the other's requests. Asserted, per turn: a session's first turn is pushed when decode holds nothing of it and
bypassed when decode holds the shared system prompt (another session stored it); every later turn is bypassed
(decode holds the turns before it, whichever replica relayed them); a bypass moves no KV and its predicted
cached tokens are exactly decode's; every answer equals one plain instance's for the same conversation.

Between turns the test waits on state, never on time: its own subscriber to decode's KV events (the routers'
code, in this process) holds the turn's prompt and answer blocks, and both routers' views hold as many blocks
as it does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.kv_events.endpoints import endpoints_near
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber
from stack.engines import KV_EVENT_OFFSETS, Engine, Fleet
from tests.integration.families import UPSTREAM_PUSH, FamilyPool
from tests.integration.multiturn.mt_support import block_size, chat_body, reply_of
from tests.integration.support import LOGS, VLLM, metric, tiny_model
from tests.integration.vllm_support import kv_sources, prompt_text, push_replicas

pytestmark = [*VLLM, pytest.mark.family(UPSTREAM_PUSH)]
SESSIONS, TURNS = 3, 4
WAIT_S = 60.0  # a bound for a failure's message, not a timed assertion


@dataclass
class Bed:
    prefill: Engine
    decode: Engine
    replicas: tuple[str, str]
    block: int


@pytest.fixture(scope="module")
def bed(family_pool: FamilyPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    family = family_pool.get(UPSTREAM_PUSH)
    prefill, decode = family.engines.prefills[0], family.engines.decode
    block = block_size(decode.url)
    offset, replay = KV_EVENT_OFFSETS
    config: Path = tmp_path_factory.mktemp("exact-replicas") / "router.yaml"
    config.write_text(
        "decider:\n  name: session-affinity\n"
        f"  bypass_max_uncached_tokens: {256 + block}\n  block_tokens: {block}\n  tokenizer: {tiny_model()}\n"
        f"kv_events:\n  port_offset: {offset}\n  replay_offset: {replay}\n",
        encoding="utf-8",
    )
    with Fleet(LOGS) as routers:
        urls = push_replicas(routers, prefill, decode, config, "exact-replica")
        yield Bed(prefill, decode, (urls[0], urls[1]), block)


def _held(router: str, worker: str) -> float:
    return metric(router, "kvpush_kv_events_held_blocks", worker=worker)


def _counts(router: str) -> dict[str, float]:
    return {
        "bypass": metric(router, "kvpush_decisions_total", route="bypass"),
        "predicted": metric(router, "kvpush_bypass_predicted_cached_tokens"),
        "actual": metric(router, "kvpush_bypass_actual_cached_tokens"),
        "checked": metric(router, "kvpush_bypass_checked"),
    }


async def _until(done: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@dataclass
class Seen:
    bypassed: bool
    moved: dict[str, float]
    predicted: float
    actual: float


async def test_turns_alternating_replicas_bypass_whenever_decode_holds_the_prefix(bed: Bed) -> None:
    decode = bed.decode.engine_spec
    offset, replay = KV_EVENT_OFFSETS
    (endpoint,) = endpoints_near("d", decode.url, decode.http_port + offset, decode.http_port + replay)
    subscriber = KvEventSubscriber(KvIndex(200_000))
    subscriber.add([endpoint])
    task = asyncio.create_task(subscriber.run())
    system = {"role": "system", "content": "You answer briefly. " + prompt_text(40)}
    histories: list[list[dict[str, str]]] = [[system] for _ in range(SESSIONS)]
    sessions = [f"exact-{uuid.uuid4().hex[:8]}-{s}" for s in range(SESSIONS)]
    seen: dict[tuple[int, int], Seen] = {}
    try:
        async with httpx.AsyncClient(timeout=120.0) as client:
            for turn in range(TURNS):
                for s in range(SESSIONS):
                    router = bed.replicas[(s + turn) % 2]  # turns alternate; sessions start on either replica
                    histories[s] = [*histories[s], {"role": "user", "content": f"Turn {turn}: " + prompt_text(8)}]
                    body = chat_body(histories[s])
                    before, sources = _counts(router), kv_sources(bed.decode.url)
                    got = await client.post(
                        f"{router}/v1/chat/completions", json=body, headers={"X-Session-ID": sessions[s]}
                    )
                    reply = reply_of(got)
                    single = reply_of(await client.post(f"{bed.prefill.url}/v1/chat/completions", json=body))
                    assert reply.text == single.text, (turn, s)  # the same answer as one plain instance
                    after = kv_sources(bed.decode.url)
                    counts = _counts(router)
                    seen[(turn, s)] = Seen(
                        counts["bypass"] > before["bypass"],
                        {k: after[k] - before_k for k, before_k in sources.items()},
                        counts["predicted"] - before["predicted"],
                        counts["actual"] - before["actual"],
                    )
                    histories[s] = [*histories[s], {"role": "assistant", "content": reply.text}]
                    computed = reply.prompt_tokens + reply.completion_tokens - 1
                    want = computed // bed.block * bed.block
                    await _until(
                        lambda: subscriber.index.session_tokens(sessions[s]).get("d", 0) >= want,  # noqa: B023
                        f"decode's events did not show session {s} turn {turn}'s blocks",
                    )
                    mine = subscriber.index.blocks("d")
                    for replica in bed.replicas:
                        await _until(
                            lambda: _held(replica, bed.decode.url) >= mine,  # noqa: B023
                            f"{replica} did not catch up with decode's events",
                        )
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()
    first = {s: seen[(0, s)] for s in range(SESSIONS)}
    assert not first[0].bypassed, first  # nothing of it held anywhere: both legs
    assert all(first[s].bypassed for s in range(1, SESSIONS)), first  # the shared system prompt is on decode
    later = {key: v for key, v in seen.items() if key[0] > 0}
    assert all(v.bypassed for v in later.values()), {k: v for k, v in later.items() if not v.bypassed}
    for key, v in seen.items():
        if v.bypassed:
            assert v.moved["external_kv_transfer"] == 0, (key, v)  # no prefill leg, no KV moved
            assert v.predicted == v.actual, (key, v)  # decode's cached tokens, predicted exactly
    per_replica = [sum(1 for (t, s), v in seen.items() if v.bypassed and (s + t) % 2 == r) for r in (0, 1)]
    assert sum(per_replica) == SESSIONS * TURNS - 1, per_replica
