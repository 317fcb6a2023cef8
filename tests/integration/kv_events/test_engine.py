"""A real vLLM CPU engine started with --kv-events-config: a prompt's blocks appear in the subscriber's index,
block by block with the prompt's own token ids, so `held_prefix` finds the whole prompt on that engine, and
counted for the request's X-Session-ID.

Starts one engine (about 30 s on the test box) under /tmp/kvpush-vllm.lock (taken here unless a parent such as
`flock /tmp/kvpush-vllm.lock pytest ...` holds it already). The engine publishes on ipc:// and answers replays
on loopback tcp.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.bench.procs import vllm_lock
from router.kv_events.endpoints import Endpoint, endpoints_for
from router.kv_events.frames import Layout
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber
from router.kv_events.view import KvEventView
from stack.engines import Engine, EngineSpec, Fleet
from stack.procs import free_port
from tests.integration.support import LOGS, STARTUP_TIMEOUT, VLLM, require_vllm, tiny_model

pytestmark = VLLM
PROMPT = [300 + (i * 7) % 1500 for i in range(300)]  # token ids of the tiny model's vocabulary (2048)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Endpoint]]:
    require_vllm()
    events = f"ipc://{tmp_path_factory.mktemp('kv-events') / 'pub'}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": "kv",
    }
    spec = EngineSpec(
        name=f"kv-events-{uuid.uuid4().hex[:6]}",
        role="single",
        model=tiny_model(),
        core=0,
        extra_args=("--kv-events-config", json.dumps(config)),
    )
    with vllm_lock(), Fleet(LOGS) as fleet:
        (started,) = fleet.start_all([spec])
        fleet.wait_all_healthy(STARTUP_TIMEOUT)
        yield started, endpoints_for("e0", events, replay, "kv")[0]


async def test_a_prompts_blocks_appear_with_its_token_ids(engine: tuple[Engine, Endpoint], tmp_path: Path) -> None:
    server, endpoint = engine
    session = f"kv-events-{uuid.uuid4().hex[:8]}"
    subscriber = KvEventSubscriber(KvIndex(100_000))
    view = KvEventView(subscriber.index, subscriber.status)
    subscriber.add([endpoint])
    task = asyncio.create_task(subscriber.run())
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as client:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            answer = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
            assert answer.status_code == 200, answer.text
        stream = subscriber.index.stream("e0", 0)
        deadline = time.monotonic() + 30
        while stream.block_size is None or view.held_prefix("e0", PROMPT).blocks < len(PROMPT) // stream.block_size:
            assert time.monotonic() < deadline, f"the prompt's blocks did not arrive: {view.status('e0')}"
            await asyncio.sleep(0.05)
        assert stream.block_size is not None
        whole = len(PROMPT) // stream.block_size
        held = view.held_prefix("e0", PROMPT)
        assert (held.blocks, held.tokens, held.rank) == (whole, whole * stream.block_size, 0)
        assert view.held_prefix("e0", [PROMPT[0] + 1, *PROMPT[1:]]).blocks == 0  # another first token: nothing
        assert view.caught_up("e0"), view.status("e0")
        assert view.session_holders(session).get("e0", 0) >= whole  # the engine tagged them with the session
        assert subscriber.frames.layouts.get(Layout.ARRAY_MAP.value, 0) >= 1
        assert (subscriber.frames.malformed, subscriber.frames.oversized, subscriber.sequence.holes) == (0, 0, 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()
