"""Anthropic's Messages API (`POST /v1/messages`) through P/D: what differs from chat. Pure.

vLLM (0.32) serves `/v1/messages` by turning it into a chat request (`vllm/entrypoints/anthropic/serving.py`), and
passes `kv_transfer_params` both ways like chat: a prefill leg's answer carries them, a decode leg takes them. So
P/D is the chat path with:
- the request checked as Anthropic's (`parse`: `max_tokens` is required, `messages` a non-empty list);
- errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (`error_body`, `error_event`);
- usage in Anthropic's shape: `input_tokens` is the prompt less the cached tokens, `cache_read_input_tokens` the
  cached ones. Through push, decode counts the KV it received as read from its cache; `with_cached` makes the
  count P's (router/usage.py's rule) and moves the difference back into `input_tokens`, so the prompt's total
  (`input_tokens + cache_read_input_tokens + cache_creation_input_tokens`) is unchanged. Every Messages answer and
  stream carries usage (vLLM streams it in `message_start` and `message_delta`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from router.errors import BadRequest, RouterError

_CHARS_PER_TOKEN = 4
_USAGE = re.compile(rb'"usage":(\s*)(\{[^{}]*\})')
_decode = msgspec.json.Decoder().decode
READ = "cache_read_input_tokens"
CREATED = "cache_creation_input_tokens"
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); others: api_error
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def parse(body: dict[str, Any]) -> int:
    """Checks what the router relies on in a Messages request; returns the prompt's estimated tokens."""
    max_tokens = body.get("max_tokens")
    if max_tokens.__class__ is not int or max_tokens < 1:
        raise BadRequest("'max_tokens' is required and must be a positive integer", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
    chars = _text_chars(body.get("system"), "system")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        chars += _text_chars(message.get("content"), f"messages[{i}].content")
    return max(1, chars // _CHARS_PER_TOKEN)


def _text_chars(content: Any, name: str) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(block.get("text", ""))) for block in content if isinstance(block, dict))
    raise BadRequest(f"{name} must be a string or a list of content blocks", param=name.split("[")[0])


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error")


def error_body(error: RouterError) -> bytes:
    """A router error as Anthropic's error body (the message as the OpenAI body would say it)."""
    message = error.to_body()["error"]["message"]
    body = {"type": "error", "error": {"type": error_type(error.http_status), "message": message}}
    return json.dumps(body, ensure_ascii=True).encode()


def error_event(error: RouterError, last: bytes = b"") -> bytes:
    """An in-band error for a Messages stream whose 200 is already sent (`event: error`)."""
    return b"event: error\ndata: " + error_body(error) + b"\n\n"


def with_cached(data: bytes, cached: int | None) -> bytes:
    """`data` (a whole answer or whole events) with every usage object's cache read made `cached`; with None (P
    did not say), no cache read is stated and the whole prompt is `input_tokens`."""

    def rewrite(match: re.Match[bytes]) -> bytes:
        try:
            usage = _decode(match.group(2))
        except (msgspec.DecodeError, ValueError):
            return match.group(0)
        if not isinstance(usage, dict):
            return match.group(0)
        return b'"usage":' + match.group(1) + json.dumps(fixed_usage(usage, cached), separators=(",", ":")).encode()

    return _USAGE.sub(rewrite, data) if b'"usage"' in data else data


def fixed_usage(usage: dict[str, Any], cached: int | None) -> dict[str, Any]:
    """A parsed Anthropic usage object under the same rule as `with_cached`."""
    if not _count(usage.get("input_tokens")):
        return usage
    read, created = usage.get(READ), usage.get(CREATED)
    prompt = usage["input_tokens"] + (read if _count(read) else 0) + (created if _count(created) else 0)
    out = {key: value for key, value in usage.items() if key != READ}
    new_read = min(cached, prompt) if cached is not None else 0
    out["input_tokens"] = max(0, prompt - new_read - (created if _count(created) else 0))
    if cached is not None:
        out[READ] = new_read
    return out


def openai_usage(payload: Any) -> dict[str, Any] | None:
    """The usage of a Messages answer or event (`message_start` carries it in its message) as OpenAI states it."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if usage is None and isinstance(payload.get("message"), dict):
        usage = payload["message"].get("usage")
    if not isinstance(usage, dict) or not _count(usage.get("input_tokens")):
        return None
    read, created = usage.get(READ), usage.get(CREATED)
    prompt = usage["input_tokens"] + (read if _count(read) else 0) + (created if _count(created) else 0)
    output = usage.get("output_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output if _count(output) else 0,
        "prompt_tokens_details": {"cached_tokens": read} if _count(read) else None,
    }


def prefill_cached(answer: dict[str, Any]) -> int | None:
    """What a prefill leg's Messages answer says P found in its prefix cache (its usage)."""
    usage = answer.get("usage")
    read = usage.get(READ) if isinstance(usage, dict) else None
    return read if _count(read) else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
