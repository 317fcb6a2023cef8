"""Multi-turn on real vLLM: a push pair with prefix caching and per-request cached-token usage, and one turn
sent as the router sends it (push: both legs at once) or to decode alone (bypass)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from router import protocol
from router.domain import Endpoint, NixlIdentity
from stack.engines import Engine
from tests.integration.families import DETAILS, Family
from tests.integration.vllm_support import MODEL, kv_sources, wait_for


@dataclass
class PushPair:
    prefill: Engine
    decode: Engine

    @property
    def identity(self) -> NixlIdentity:
        spec = self.prefill.engine_spec
        assert spec.engine_id is not None and spec.side_port is not None
        return NixlIdentity(spec.engine_id, "127.0.0.1", spec.side_port)

    def prefill_arg(self) -> str:
        """The router's --prefill SPEC for this pair's prefill engine."""
        return self.prefill.engine_spec.prefill_arg()


def push_pair(family: Family) -> PushPair:
    """The shared push family's p0 (core 0) and decode (core 1): prefix caching on (vLLM's default), cached tokens
    reported (`--enable-prompt-tokens-details`, on in `UPSTREAM_PUSH`), a fresh NIXL identity per start."""
    assert DETAILS in family.spec.extra_args, "the family must report cached tokens"
    return PushPair(family.engines.prefills[0], family.engines.decode)


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int


def reply_of(response: httpx.Response) -> Reply:
    assert response.status_code == 200, response.text
    data = response.json()
    usage = data["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        data["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        details.get("cached_tokens"),
        usage["completion_tokens"],
    )


def chat_body(messages: list[dict[str, str]], max_tokens: int = 24) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def post_chat(url: str, body: dict[str, Any], request_id: str | None = None, timeout: float = 120.0) -> httpx.Response:
    headers = {"X-Request-Id": request_id or f"mt-{uuid.uuid4().hex}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def push_turn(pair: PushPair, body: dict[str, Any]) -> Reply:
    """Both legs at once, with exactly the bodies and ids the router's push path sends."""
    ids = protocol.mint_ids()
    with ThreadPoolExecutor(2) as pool:
        d_leg = pool.submit(
            post_chat, pair.decode.url, protocol.push_decode_body(body, pair.identity, ids), ids.request_id
        )
        p_leg = pool.submit(
            post_chat, pair.prefill.url, protocol.prefill_body(body, Endpoint.CHAT, ids.transfer_id), ids.request_id
        )
        assert p_leg.result().status_code == 200, p_leg.result().text
        return reply_of(d_leg.result())


def sources_delta(url: str, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """Decode's prompt tokens by source since `before`, once they add up to the request's prompt."""

    def now() -> dict[str, float]:
        after = kv_sources(url)
        return {k: after[k] - before[k] for k in after}

    wait_for(lambda: sum(now().values()) >= prompt_tokens, "decode counted the prompt's tokens by source")
    return now()


def block_size(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{") and 'block_size="' in line:
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise AssertionError("vllm:cache_config_info has no block_size")
