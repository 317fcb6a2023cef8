"""True usage through P/D: the prompt's cached tokens are what the prefill engine found in its prefix cache.

A decode engine that received the prompt's KV from P counts that KV as a prefix-cache hit, so through P/D every
answer would read 100 % cached. The rule (the same as vllm-router's): `prompt_tokens` and the output counts are
decode's, `prompt_tokens_details.cached_tokens` is P's. vLLM 0.32 puts P's count into the params P answers with
(`remote_prefill_cached_tokens`), and a decode engine given those params reports it itself: pull relays P's
params, so pull needs nothing from the router. Push sends decode's params before P has run, so the router
rewrites the count in decode's answer: `with_cached` for a whole answer, `CachedFix` for a stream relayed byte
for byte. A bypass (decode alone) is decode's own count, true as it comes.

Pure apart from `CachedFix.resolve`, which awaits P's count once (the prefill leg may still be answering).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeGuard

import msgspec

REMOTE_CACHED = "remote_prefill_cached_tokens"  # vLLM's key in P's answered kv_transfer_params
# A quote inside a JSON string is escaped, so neither pattern can match text the model wrote.
_CACHED = re.compile(rb'"cached_tokens":(\s*)(?:-?[0-9]+|null)')
_DETAILS = re.compile(rb'"prompt_tokens_details":(\s*)\{[^{}]*\}')
_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_decode = msgspec.json.Decoder().decode


def prefill_cached(answer: Any) -> int | None:
    """What P found in its prefix cache, as its answer states it (its params, else its usage: chat's and
    completions' `prompt_tokens_details`, Responses' `input_tokens_details`, Messages' `cache_read_input_tokens`),
    or None."""
    if not isinstance(answer, dict):
        return None
    params = answer.get("kv_transfer_params")
    stated = params.get(REMOTE_CACHED) if isinstance(params, dict) else None
    if _count(stated):
        return stated
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))  # chat, completions; Responses
    stated = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens")
    return stated if _count(stated) else None


def usage_of(answer: Any) -> dict[str, Any] | None:
    """The `usage` object of an OpenAI answer or stream chunk, if it has one."""
    found = answer.get("usage") if isinstance(answer, dict) else None
    return found if isinstance(found, dict) else None


def answered_cached(content: bytes) -> int | None:
    """The cached count a whole JSON answer states (None: none, or not JSON)."""
    if b'"cached_tokens"' not in content:
        return None
    try:
        answer = _decode(content)
    except (msgspec.DecodeError, ValueError):
        return None
    found = _get(_get(answer, "usage"), "prompt_tokens_details").get("cached_tokens")
    return found if _count(found) else None


def _get(parent: Any, key: str) -> dict[str, Any]:
    child = parent.get(key) if isinstance(parent, dict) else None
    return child if isinstance(child, dict) else {}


def relays_cached(params: Mapping[str, Any]) -> bool:
    """P's params carry its count: a decode engine given them reports it (pull)."""
    return _count(params.get(REMOTE_CACHED))


def wants_usage(body: Mapping[str, Any]) -> bool:
    """The answer carries usage: every JSON answer, a stream only when the client asked for it."""
    if not body.get("stream"):
        return True
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage") or options.get("continuous_usage_stats"))


def with_cached(data: bytes, cached: int | None) -> bytes:
    """`data` (whole JSON answers or whole events) with every `cached_tokens` set to `cached`; with None (P did
    not say), `prompt_tokens_details` becomes null rather than decode's count."""
    if b'"cached_tokens"' not in data:
        return data
    if cached is None:
        return _DETAILS.sub(rb'"prompt_tokens_details":\g<1>null', data)
    return _CACHED.sub(b'"cached_tokens":\\g<1>' + str(cached).encode(), data)


def fixed_usage(usage: dict[str, Any] | None, cached: int | None) -> dict[str, Any] | None:
    """A parsed usage object with the same rule as `with_cached` (for the record, the trace, the decider)."""
    if usage is None or not isinstance(usage.get("prompt_tokens_details"), dict):
        return usage
    if cached is None:
        return {**usage, "prompt_tokens_details": None}
    return {**usage, "prompt_tokens_details": {**usage["prompt_tokens_details"], "cached_tokens": cached}}


class CachedFix:
    """Rewrites a relayed stream's cached counts event by event. A chunk that ends inside an event keeps that
    event's start back until its end arrives (a client cannot use half an event anyway), so a count split
    across chunks is still found; a chunk of whole events without a count goes through as it came."""

    def __init__(
        self,
        cached: Callable[[], Awaitable[int | None]],
        rewrite: Callable[[bytes, int | None], bytes] = with_cached,
        marker: bytes = b"cached_tokens",
    ) -> None:
        self._source = cached
        self._rewrite = rewrite  # the API's (router/apis.py): OpenAI's `with_cached` by default
        self._marker = marker  # what every event that states a count contains
        self.resolved = False
        self.cached: int | None = None
        self._tail = b""

    async def resolve(self) -> None:
        self.cached = await self._source()
        self.resolved = True

    def feed(self, chunk: bytes) -> bytes | None:
        """The bytes to relay now: the whole events so far, rewritten; None when they hold a count and P's is not
        known yet (`resolve()`, then `feed(b"")`). A chunk of whole events without a count: one search."""
        if self._tail:
            chunk, self._tail = self._tail + chunk, b""
        if self._marker not in chunk:
            return chunk if chunk.endswith(_SEPARATORS) else self._whole(chunk)
        if not self.resolved:
            self._tail = chunk
            return None
        return self._rewrite(self._whole(chunk), self.cached)

    def _whole(self, chunk: bytes) -> bytes:
        """`chunk` up to its last event's end; the rest is kept for the next chunk."""
        end = max((i + len(sep) for sep in _SEPARATORS if (i := chunk.rfind(sep)) >= 0), default=0)
        self._tail = chunk[end:]
        return chunk[:end]

    async def flush(self) -> bytes:
        """An unterminated last event (the stream ended without its blank line), rewritten."""
        tail, self._tail = self._tail, b""
        if self._marker not in tail:
            return tail
        if not self.resolved:
            await self.resolve()
        return self._rewrite(tail, self.cached)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
