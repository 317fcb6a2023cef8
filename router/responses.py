"""OpenAI's Responses API (`POST /v1/responses`) through P/D: what differs from chat. Pure.

vLLM (0.32) takes and returns `kv_transfer_params` on `/v1/responses` (`vllm/entrypoints/openai/responses/`), so a
first turn is an ordinary pair: P gets the request cut to one token with `store: false` (P's one-token stub must
never be found by a later `previous_response_id`), decode gets the client's request plus the mode's params.

State (`store: true`, with `VLLM_ENABLE_RESPONSES_API_STORE=1` on the engines) lives in the process of the decode
that answered: vLLM keeps it in memory. The response id is vLLM's body field `request_id`, which the router mints
for each attempt (`owned`) as `resp_<owner>_<32 hex>`, `<owner>` a digest of the decode worker's URL. Any router
(replicas, a restart) finds that decode again from the id alone, among its own configured decode workers
(`owner_of`): nothing is shared, and an id never names a host; an id that names no configured decode (forged, or
its decode gone) is a 404 before any connection. `previous_response_id`, `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` go to that decode alone (a follow-up is a bypass: only that engine holds the
conversation, and its prefix cache holds the previous turn).

Refused before any leg leaves (400, naming the field): `background` (its result would live in one engine's
process while the router answered), built-in tools and input items that only an engine's store or tool loop can
serve (vLLM would loop new engine requests with the same `kv_transfer_params`), a client's `request_id` (it would
name no decode), and `kv_transfer_params` (protocol.py).

Streams: vLLM sends `response.created` and `response.in_progress` before the engine request is even submitted;
the router holds them (`held`) until the first real event, so the first-byte deadline still catches a decode
waiting for KV that never comes and a failed prefill is still retried. Events are `event:`-led; a router-made
in-band error is an `error` event numbered after the last one relayed (`error_event`). Usage is in
`response.usage` (`input_tokens_details.cached_tokens`, made P's by `with_cached`).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable
from typing import Any

from router.errors import BadRequest, RouterError

_CHARS_PER_TOKEN = 4
_ID = re.compile(r"resp_([0-9a-f]{16})_[0-9a-f]{32}")
_PERSON = b"kvpush-owner"
HELD = (b"event: response.created\n", b"event: response.in_progress\n")
# Input items that are prompt text (or client-side tool traffic) the engine renders into the prompt itself.
PROMPT_ITEMS = frozenset(
    {"message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning"}
)
CLIENT_TOOLS = frozenset({"function", "custom"})  # executed by the client: rendered into the prompt, fine
_CACHED = re.compile(rb'"cached_tokens":(\s*)(?:[0-9]+|null)')
_PER_TURN = re.compile(rb'"cached_tokens_per_turn":(\s*)\[\s*[0-9]+\s*\]')
_SEQUENCE = re.compile(rb'"sequence_number":\s*([0-9]+)')


def parse(body: dict[str, Any]) -> int:
    """Checks a Responses request against what P/D can serve; returns the prompt's estimated tokens."""
    value = body.get("max_output_tokens")
    if value is not None and (value.__class__ is not int or value < 1):
        raise BadRequest("'max_output_tokens' must be a positive integer", param="max_output_tokens")
    if body.get("background"):
        raise BadRequest(
            "'background' is not served through disaggregated serving: its result would live in one engine's "
            "process; stream the response instead",
            param="background",
        )
    if "request_id" in body:
        raise BadRequest("'request_id' is set by the router (the response id names its decode)", param="request_id")
    for key in ("store", "stream"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"'{key}' must be a boolean", param=key)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise BadRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
    _check_tools(body.get("tools"))
    chars = len(body["instructions"]) if isinstance(body.get("instructions"), str) else 0
    return max(1, (chars + _input_chars(body.get("input"))) // _CHARS_PER_TOKEN)


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in CLIENT_TOOLS:
            raise BadRequest(
                f"tools[{i}]: type {kind!r} is not served through disaggregated serving (only client-executed "
                "'function' and 'custom' tools are: a built-in tool loops engine requests)",
                param="tools",
            )


def _input_chars(items: Any) -> int:
    if isinstance(items, str) and items:
        return len(items)
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' is required: a non-empty string or a non-empty list of items", param="input")
    chars = 0
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in PROMPT_ITEMS:
            raise BadRequest(
                f"input[{i}]: item type {kind!r} is not served through disaggregated serving (served: "
                f"{', '.join(sorted(PROMPT_ITEMS))})",
                param="input",
            )
        content = item.get("content", item.get("output", item.get("arguments")))
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return chars


def owner_token(url: str) -> str:
    """The 16 hex digits that name a decode worker in the response ids it holds."""
    return hashlib.blake2b(url.encode(), digest_size=8, person=_PERSON).hexdigest()


def response_id(url: str) -> str:
    """A fresh response id held by the decode worker at `url`."""
    return f"resp_{owner_token(url)}_{uuid.uuid4().hex}"


def owned(body: dict[str, Any], url: str) -> dict[str, Any]:
    """A top-level copy of the client's body whose response will be held by the decode worker at `url`."""
    return {**body, "request_id": response_id(url)}


def owner_of(response: str, urls: Iterable[str]) -> str | None:
    """The configured decode worker (one of `urls`) that holds `response`, or None (not a router-made id, or its
    decode is not configured here): an id only ever selects a member of the pool."""
    match = _ID.fullmatch(response)
    if match is None:
        return None
    token = match.group(1)
    return next((url for url in urls if owner_token(url) == token), None)


def not_found(response: str) -> str:
    return f"response {response!r} not found: no decode worker of this router holds it"


def held(event: bytes) -> bool:
    """The events vLLM sends before the engine request is submitted (not yet a sign of life)."""
    return event.startswith(HELD)


def error_event(error: RouterError, last: bytes = b"") -> bytes:
    """An in-band error for a Responses stream whose 200 is already sent, numbered after the last event in
    `last` (the last chunk relayed)."""
    numbers = _SEQUENCE.findall(last)
    body = error.to_body()["error"]
    payload = {
        "type": "error",
        "code": str(body["type"]),
        "message": body["message"],
        "param": body["param"],
        "sequence_number": int(numbers[-1]) + 1 if numbers else 0,
    }
    return b"event: error\ndata: " + json.dumps(payload, ensure_ascii=True).encode() + b"\n\n"


def with_cached(data: bytes, cached: int | None) -> bytes:
    """`data` (a whole answer or whole events) with `input_tokens_details.cached_tokens` (and its one-turn
    `cached_tokens_per_turn`) made `cached`; null when P did not say."""
    if b"cached_tokens" not in data:
        return data
    count = b"null" if cached is None else str(cached).encode()
    data = _CACHED.sub(b'"cached_tokens":\\g<1>' + count, data)
    return _PER_TURN.sub(b'"cached_tokens_per_turn":\\g<1>[' + count + b"]", data)


def usage_of(payload: Any) -> dict[str, Any] | None:
    """The usage of a Responses answer, or of the event (`response.completed`) that carries it."""
    if not isinstance(payload, dict):
        return None
    response = payload.get("response", payload)
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else None


def openai_usage(payload: Any) -> dict[str, Any] | None:
    """The usage of a Responses answer or event as OpenAI's completions state it."""
    usage = usage_of(payload)
    if usage is None:
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }
