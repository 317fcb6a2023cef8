"""Span names and attributes of the router's traces, as pure builders. OpenTelemetry's GenAI semantic conventions
where they have a name (`gen_ai.*`, `error.type`, `server.*`, `http.*`), `kvpush.*` for what is ours.

The tree of one client request (names below; see router/tracing/trace.py for when each starts and ends):

    {operation} {model}                 SERVER   the client's request (a child of the client's traceparent, else a root)
    ├── kvpush.prefill                  CLIENT   one per prefill leg; a retry is a new one with kvpush.attempt + 1
    │   └── llm_request  (prefill vLLM)          the engine's own span, a child through the injected traceparent
    └── kvpush.decode                   CLIENT   one per decode leg, to the end of its stream
        │   event kvpush.first_byte              decode's first byte, with kvpush.handoff.seconds (prefill
        │                                        answered → this byte) when the attempt had a prefill leg
        └── llm_request  (decode vLLM)

The handoff is an event, not a span of its own: a span costs about twice an event per request (made, then
encoded for export), and bench/README.md's tracing overhead is counted per request.

`gen_ai.request.id` on a leg is the id the worker saw (X-Request-Id, the pairing id), the same attribute vLLM puts
on its `llm_request` span; the client's own request id is `kvpush.request.id` on the server span.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

Attributes = dict[str, str | bool | int | float]

# OpenTelemetry semantic conventions (GenAI, error, server, HTTP).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_ID = "gen_ai.request.id"  # not (yet) in the conventions; vLLM's name on llm_request
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
# kvpush's own.
REQUEST_ID = "kvpush.request.id"  # the client-facing request id (X-Request-Id of the answer)
PAIRING_ID = "kvpush.pairing_id"  # the attempt's id shared by both legs
TRANSFER_ID = "kvpush.transfer_id"
ROUTE = "kvpush.route"  # what served it: push | pull | bypass | decode-only
ATTEMPT = "kvpush.attempt"  # 1-based attempt number of a leg
ATTEMPTS = "kvpush.attempts"  # attempts the request took
OUTCOME = "kvpush.outcome"  # ok, or the error kind (router/errors.py), or client_gone
HANDOFF_SECONDS = "kvpush.handoff.seconds"

PROVIDER = "vllm"
OPERATIONS = {"chat": "chat", "completions": "text_completion"}  # Endpoint value → operation name
PREFILL_SPAN = "kvpush.prefill"
DECODE_SPAN = "kvpush.decode"
FIRST_BYTE_EVENT = "kvpush.first_byte"
OK = "ok"
CLIENT_GONE = "client_gone"
CANCELLED = "cancelled"  # a leg given up: the client left, or the other leg failed first
NOT_ERRORS = frozenset({OK, CLIENT_GONE, CANCELLED})  # outcomes that are no error of the span's own


MAX_MODEL_CHARS = 128  # the client names the model: what goes into a span name or attribute is bounded


def model_of(value: Any) -> str | None:
    """The client's model name as it may appear in a span (a string, at most MAX_MODEL_CHARS), else None."""
    return value[:MAX_MODEL_CHARS] if isinstance(value, str) and value else None


def operation(endpoint: str) -> str:
    """The GenAI operation name of an endpoint (`chat`, `completions`)."""
    return OPERATIONS.get(endpoint, endpoint)


def server_span_name(endpoint: str, model: Any) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, as the GenAI conventions name inference spans."""
    op, name = operation(endpoint), model_of(model)
    return f"{op} {name}" if name else op


def request_attributes(*, endpoint: str, model: Any, max_tokens: Any, request_id: str) -> Attributes:
    """The server span's attributes known on arrival (the client's body already parsed and checked)."""
    model = model_of(model)
    out: Attributes = {
        GEN_AI_OPERATION_NAME: operation(endpoint),
        GEN_AI_PROVIDER_NAME: PROVIDER,
        REQUEST_ID: request_id,
    }
    if model:
        out[GEN_AI_REQUEST_MODEL] = model
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        out[GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    return out


def leg_attributes(*, attempt: int, pairing_id: str, address: Attributes) -> Attributes:
    """A leg span's attributes: the attempt, the id the worker saw (the pairing id) and the worker's address
    (`address_of(worker)`, computed once per worker). Kept short: every attribute is paid for per request, twice
    (set, then encoded for export)."""
    return {ATTEMPT: attempt, GEN_AI_REQUEST_ID: pairing_id, **address}


def address_of(url: str) -> Attributes:
    """`server.address` and `server.port` of a worker's base URL (nothing for what does not parse)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return {}
    return {SERVER_ADDRESS: parts.hostname, SERVER_PORT: port} if parts.hostname else {}


def outcome_attributes(outcome: str, *, status: int | None = None) -> Attributes:
    """`kvpush.outcome`, `error.type` (the error kind) unless ok or the client left, the HTTP status if known
    (the server span's)."""
    out: Attributes = {OUTCOME: outcome}
    if outcome not in NOT_ERRORS:
        out[ERROR_TYPE] = outcome
    if status is not None:
        out[HTTP_RESPONSE_STATUS_CODE] = status
    return out


def leg_failure_attributes(outcome: str, *, status: int | None = None) -> Attributes:
    """What a leg that did not end "ok" adds: `error.type` (or `kvpush.outcome` for a client that left) and the
    worker's HTTP status when it answered with one. An "ok" leg adds nothing."""
    if outcome == OK:
        return {}
    out: Attributes = {OUTCOME: outcome} if outcome in NOT_ERRORS else {ERROR_TYPE: outcome}
    if status is not None:
        out[HTTP_RESPONSE_STATUS_CODE] = status
    return out


def end_attributes(
    *, route: str, attempts: int, pairing_id: str | None, transfer_id: str | None, usage: Mapping[str, Any] | None
) -> Attributes:
    """The server span's attributes known at the end: what served it, after how many attempts, the last attempt's
    ids, and the token counts when the answer reported usage."""
    out: Attributes = {ROUTE: route, ATTEMPTS: attempts}
    if pairing_id is not None:
        out[PAIRING_ID] = pairing_id
    if transfer_id is not None:
        out[TRANSFER_ID] = transfer_id
    if usage:
        out.update(usage_attributes(usage))
    return out


def usage_attributes(usage: Mapping[str, Any] | None) -> Attributes:
    """Token counts from an OpenAI `usage` object: input, output and cached input tokens (those present)."""
    if not usage:
        return {}
    out: Attributes = {}
    for key, name in (("prompt_tokens", GEN_AI_USAGE_INPUT_TOKENS), ("completion_tokens", GEN_AI_USAGE_OUTPUT_TOKENS)):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if isinstance(cached, int) and not isinstance(cached, bool):
        out[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
    return out
