"""vLLM P/D wire shaping: request validation, id minting, and the bodies of both legs. Pure, table-tested."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import msgspec

from router import messages, responses
from router.domain import Endpoint, NixlIdentity, RequestInfo
from router.errors import BadRequest

REQUEST_ID_HEADER = "x-request-id"
PAIRING_ID_HEADER = "x-kvpush-pairing-id"
_SAFE_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]+")
_decode = msgspec.json.Decoder().decode
encode = msgspec.json.Encoder().encode  # the one dump per leg


def decode_json(raw: bytes) -> Any:
    """A worker's JSON (trusted shape, still strict); raises ValueError."""
    try:
        return _decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


class KvTransferParams(TypedDict, total=False):
    """`kv_transfer_params` as the router writes and reads it (the connector's parsers are the other side)."""

    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str | None
    remote_block_ids: list[Any] | None
    remote_host: str | None
    remote_port: int | None
    remote_request_id: str
    tp_size: int
    pp_size: int
    transfer_id: str
    transfer_mode: str


# vLLM strips this suffix from request ids when it pairs legs by id; our ids must never end with it.
_VLLM_ID_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_CHARS_PER_TOKEN = 4  # prompt-size estimate for text prompts; only used to balance load


@dataclass(frozen=True)
class PairingIds:
    """One dispatch attempt's ids: the X-Request-Id both legs carry and the transfer id both params carry."""

    request_id: str
    transfer_id: str


def mint_ids() -> PairingIds:
    ids = PairingIds(request_id=f"kvp-{uuid.uuid4().hex}", transfer_id=f"xfer-{uuid.uuid4().hex}")
    assert is_safe_request_id(ids.request_id)
    return ids


def is_safe_request_id(request_id: str) -> bool:
    """False when vLLM's base-id fallback would strip part of the id (it ends in '-' and 8 hex digits)."""
    return _VLLM_ID_SUFFIX.search(request_id) is None


def client_request_id(raw: str | None, max_chars: int) -> str:
    """The client's x-request-id when it is short and plain ([A-Za-z0-9._:-]); else a fresh one (never echoed)."""
    if raw and len(raw) <= max_chars and _SAFE_CLIENT_ID.fullmatch(raw):
        return raw
    return f"req-{uuid.uuid4().hex}"


def decode_body(raw: bytes, max_depth: int) -> Any:
    """The client's JSON: strict (no NaN/Infinity, no lone surrogates, numbers in range), nesting ≤ max_depth."""
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, RecursionError, ValueError):
        raise BadRequest("the request body is not valid JSON") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(body) > max_depth:
        raise BadRequest(f"the request body nests deeper than {max_depth} levels")
    return body


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, iteratively (a hostile body cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


DEFAULT_MAX_N = 16  # router/config.py Limits.max_n
DEFAULT_MAX_BATCH = 64  # router/config.py Limits.max_batch_prompts
_GREEDY = 1e-5  # vLLM samples greedily below this temperature (and then refuses n > 1)


def parse_request(
    endpoint: Endpoint, body: Any, *, max_n: int = DEFAULT_MAX_N, max_batch: int = DEFAULT_MAX_BATCH
) -> RequestInfo:
    """Checks what the router relies on and returns the facts selection needs; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer", param=key)
    if "kv_transfer_params" in body:
        raise BadRequest(
            "'kv_transfer_params' is set by the router and must not be sent by clients", param="kv_transfer_params"
        )
    if endpoint is Endpoint.MESSAGES:
        return RequestInfo(endpoint=endpoint, stream=stream, prompt_tokens=messages.parse(body))
    if endpoint is Endpoint.RESPONSES:
        return RequestInfo(endpoint=endpoint, stream=stream, prompt_tokens=responses.parse(body))
    n, best_of = body.get("n"), body.get("best_of")
    if (n is not None and (n.__class__ is not int or n != 1)) or best_of is not None:
        _check_choices(n, best_of, max_n, body.get("temperature"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    tokens = _prompt_tokens(body, max_batch) if endpoint is Endpoint.COMPLETIONS else _chat_tokens(body)
    return RequestInfo(endpoint=endpoint, stream=stream, prompt_tokens=tokens)


def _check_choices(n: Any, best_of: Any, max_n: int, temperature: Any) -> None:
    """`n` null or 1 is one choice (OpenAI and vLLM read null as 1); `best_of` null or 1 is no best-of."""
    if n is not None and (n.__class__ is not int or n < 1):
        raise BadRequest("'n' must be a positive integer or null", param="n")
    if n is not None and n > max_n:
        raise BadRequest(f"'n' is over this router's limit of {max_n} choices per request", param="n")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature < _GREEDY
    if n is not None and n > 1 and greedy:  # vLLM refuses it, but only once the prompt has moved
        raise BadRequest("'n' must be 1 with greedy sampling ('temperature' 0): the choices would be equal", param="n")
    if best_of is not None and (best_of.__class__ is not int or best_of != 1):
        raise BadRequest(
            "'best_of' other than 1 is not served (vLLM's engine has no best-of sampling): ask for 'n' choices",
            param="best_of",
        )


def choices(body: Mapping[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> int:
    """How many choices a validated request asks for (Messages and Responses have one)."""
    n = body.get("n")
    return n if n.__class__ is int and endpoint.openai_choices else 1


def decode_only(endpoint: Endpoint, body: Mapping[str, Any]) -> str | None:
    """Why this request must be served by decode alone (no prefill leg), or None. Each of these makes vLLM compute
    the prompt itself on the decode engine whatever KV it was sent: beam search runs its own engine requests
    without the router's `kv_transfer_params`; prompt logprobs (asked, or implied by `echo` with logprobs) skip
    every prefix-cache and connector hit. A prefill leg would compute the prompt for nothing and hold its KV."""
    if not endpoint.openai_choices:
        return None  # Messages and Responses have none of these fields
    if body.get("use_beam_search") is True:
        return "beam search"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    if body.get("echo") and body.get("logprobs" if endpoint is Endpoint.COMPLETIONS else "top_logprobs") is not None:
        return "echo with logprobs (prompt logprobs)"
    return None


def _prompt_tokens(body: dict[str, Any], max_batch: int) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return max(1, len(prompt) // _CHARS_PER_TOKEN)
    prompts = batch_of(body)
    if prompts is None:
        return _one_prompt_tokens(prompt, "'prompt'")
    if len(prompts) > max_batch:
        raise BadRequest(
            f"'prompt' holds {len(prompts)} prompts, over this router's limit of {max_batch}", param="prompt"
        )
    return sum(_one_prompt_tokens(p, f"'prompt[{i}]'") for i, p in enumerate(prompts))


def _one_prompt_tokens(prompt: Any, name: str) -> int:
    if isinstance(prompt, str) and prompt:
        return max(1, len(prompt) // _CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    raise BadRequest(f"{name} is required: a non-empty string or a non-empty list of token ids", param="prompt")


def batch_of(body: Mapping[str, Any]) -> list[Any] | None:
    """The prompts of a batched completions request (a list of strings or of token-id lists), else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], str | list):
        return None
    return prompt


def _chat_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
    return max(1, chars // _CHARS_PER_TOKEN)


def prefill_body(body: dict[str, Any], endpoint: Endpoint, transfer_id: str) -> dict[str, Any]:
    """The prefill leg: the client's request cut to one token, unstreamed, asking for a remote decode.

    Shaping copies the top level only: it sets top-level keys and never writes into the client's nested values."""
    out = _one_token(body, endpoint)
    params: KvTransferParams = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }
    out["kv_transfer_params"] = params
    return out


def first_token_body(body: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """One choice of one token, unstreamed: the pair that moves an n > 1 request's prompt into decode's prefix
    cache once (its answer is not the client's)."""
    out = _one_token(body, endpoint)
    out["n"] = 1
    return out


def _one_token(body: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """A top-level copy of the client's body cut to one token, unstreamed. A Responses prefill stores nothing
    (router/responses.py): its one-token stub must never answer a later `previous_response_id`."""
    out = dict(body)
    if endpoint is Endpoint.RESPONSES:
        out.update(max_output_tokens=1, stream=False, store=False, background=False)
        return out
    out["max_tokens"] = 1
    if endpoint is Endpoint.MESSAGES:
        out["stream"] = False
        return out
    if endpoint is Endpoint.CHAT or "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    return out


def push_decode_body(body: dict[str, Any], identity: NixlIdentity, ids: PairingIds) -> dict[str, Any]:
    """The push decode leg: the client's request plus where to register for the KV WRITE."""
    out = dict(body)
    params: KvTransferParams = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": identity.engine_id,
        "remote_host": identity.host,
        "remote_port": identity.port,
        "tp_size": identity.tp_size,
        "pp_size": identity.pp_size,
        "remote_request_id": ids.request_id,
        "transfer_id": ids.transfer_id,
    }
    out["kv_transfer_params"] = params
    return out


def pull_decode_body(body: dict[str, Any], kv_params: KvTransferParams) -> dict[str, Any]:
    """The pull decode leg: the client's request plus the params prefill returned, verbatim."""
    out = dict(body)
    out["kv_transfer_params"] = dict(kv_params)
    return out


def kv_params_of(response: Any) -> KvTransferParams | None:
    """The `kv_transfer_params` object of a prefill answer, if it has one."""
    if isinstance(response, dict) and isinstance(response.get("kv_transfer_params"), dict):
        params: KvTransferParams = dict(response["kv_transfer_params"])  # type: ignore[assignment]
        return params
    return None


def usage_of(answer: Any) -> dict[str, Any] | None:
    """The `usage` object of an OpenAI answer or stream chunk, if it has one."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None


_HIDDEN_OUTPUT = ("reasoning_content", "reasoning", "tool_calls", "function_call")


def text_of(answer: Any) -> str | None:
    """The generated text of an OpenAI answer or stream chunk (completions `text`, chat `message`/`delta`).

    None when the choice also carries output that is not in its text (reasoning, tool calls): the engine's cache
    then holds tokens that the client never sees as text, so the text is no prefix to credit (vLLM #43094)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    for key in ("message", "delta"):
        part = choice.get(key)
        if isinstance(part, dict):
            if any(part.get(hidden) for hidden in _HIDDEN_OUTPUT):
                return None
            if isinstance(part.get("content"), str):
                return str(part["content"])
    return ""


TOKEN_IDS = "return_token_ids"  # vLLM's request field: the answer carries its token ids (and the prompt's)
_TOKEN_ID_ARRAYS = re.compile(rb'"(prompt_token_ids|token_ids)":(\s*)\[[0-9,\s]*\]')


def asks_token_ids(body: Any) -> bool:
    """The client asked for the token ids itself (so they are its to see)."""
    return isinstance(body, dict) and body.get(TOKEN_IDS) is True


def asking_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of a decode body that asks vLLM for the generated token ids."""
    return {**body, TOKEN_IDS: True}


def token_ids_of(answer: Any) -> list[int] | None:
    """The generated token ids of an answer or stream chunk asked with `return_token_ids` (first choice), or
    None when it carries none."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids


def scrub_token_ids(data: bytes) -> bytes:
    """An answer or whole event as the client would have had it without `return_token_ids`: vLLM writes the
    fields as null when not asked, so the arrays become null again. A quote inside a JSON string is escaped,
    so no text the model wrote can match."""
    if b"token_ids" not in data:
        return data
    return _TOKEN_ID_ARRAYS.sub(rb'"\1":\2null', data)


def identity_from(kv_params: KvTransferParams) -> NixlIdentity | None:
    """A prefill worker's NIXL identity as its own answer states it (for workers configured as auto)."""
    try:
        return NixlIdentity(
            engine_id=str(kv_params["remote_engine_id"]),
            host=str(kv_params["remote_host"]),
            port=int(kv_params["remote_port"]),  # type: ignore[arg-type]
            tp_size=int(kv_params.get("tp_size") or 1),
            pp_size=int(kv_params.get("pp_size") or 1),
            tp_known=bool(kv_params.get("tp_size")),
        )
    except (KeyError, TypeError, ValueError):
        return None
