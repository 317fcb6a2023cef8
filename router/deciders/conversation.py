"""The conversation key of a request, without a tokenizer: a session id when the client names one, and a digest
chain over the prompt that a later turn extending this one field for field shares link for link. Pure.

A chain is a sequence of links; link i digests everything up to a point of the prompt (link 0: the model and the
prompt-shaping fields; chat: then one link per message; completions: one link per `chunk_chars` characters of
the prompt text) and carries the characters covered so far. Two requests share link i exactly when everything up
to that point is equal, so a request that edits the middle of its history shares only the links before the edit
(the strict-prefix rule of vLLM #43094: credit a cached prefix only where the text is exactly what was sent).

`extend()` appends what a worker generated (chat: an assistant message with exactly that content; completions:
the text appended to the prompt), so the next turn of a client that sends the answer back unchanged matches it,
and one that sends it back altered (reasoning stripped, whitespace trimmed) does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.domain import Endpoint

SESSION_HEADER = "x-session-id"  # vLLM's and vllm-router's convention
SESSION_FIELD = "prompt_cache_key"  # OpenAI's body field for cache routing
MAX_SESSION_CHARS = 256  # a longer id is ignored (it would only bloat the affinity table)
DEFAULT_CHUNK_CHARS = 256  # completions: one link per this many prompt characters
MESSAGE_OVERHEAD_CHARS = 12  # chat: the template's role markers per message, in characters (an estimate)

# Request fields that change the rendered prompt (or which KV a prompt maps to): part of link 0.
PROMPT_SHAPING = (
    "model",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "cache_salt",
    "mm_processor_kwargs",
    "lora_request",
)


@dataclass(frozen=True)
class ChainLink:
    digest: bytes
    chars: int  # the prompt's characters up to and including this link (chat: with an overhead per message)


@dataclass(frozen=True)
class Chain:
    """The links of one prompt, in order. Empty when the prompt has no text form (token ids)."""

    endpoint: Endpoint
    links: tuple[ChainLink, ...]
    chunk_chars: int = DEFAULT_CHUNK_CHARS
    tail: str = ""  # completions: the prompt's characters after the last whole chunk

    @property
    def chars(self) -> int:
        return (self.links[-1].chars if self.links else 0) + len(self.tail)

    def extend(self, answer: str) -> Chain:
        """The chain of the prompt followed by `answer`, as a later turn that sends it back unchanged would have."""
        if not self.links:
            return self
        if self.endpoint is Endpoint.CHAT:
            return Chain(self.endpoint, (*self.links, _message_link(self.links[-1], _answer_message(answer))))
        return _text_chain(self.endpoint, self.links, self.tail + answer, self.chunk_chars)


@dataclass(frozen=True)
class ConversationKey:
    session: str | None  # from the X-Session-ID header or the body's prompt_cache_key
    chain: Chain


def conversation_key(
    endpoint: Endpoint, body: Mapping[str, Any], headers: Mapping[str, str], chunk_chars: int = DEFAULT_CHUNK_CHARS
) -> ConversationKey:
    """The key of a validated request (`parse_request` has checked its shape). `headers` has lower-case names."""
    return ConversationKey(session_of(body, headers), chain_of(endpoint, body, chunk_chars))


def session_of(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The client's session id: the header first, else the body field; None when absent, empty or too long."""
    for value in (headers.get(SESSION_HEADER), body.get(SESSION_FIELD)):
        if isinstance(value, str) and 0 < len(value.strip()) <= MAX_SESSION_CHARS:
            return value.strip()
    return None


def chain_of(endpoint: Endpoint, body: Mapping[str, Any], chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Chain:
    if chunk_chars < 1:
        raise ValueError("chunk_chars must be positive")
    head = _head(endpoint, body)
    if endpoint is Endpoint.CHAT:
        links = [head]
        for message in body.get("messages") or ():
            links.append(_message_link(links[-1], message))
        return Chain(endpoint, tuple(links), chunk_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one is one prompt
    if not isinstance(prompt, str):
        return Chain(endpoint, (), chunk_chars)  # token ids: no text to key on
    return _text_chain(endpoint, (head,), prompt, chunk_chars)


def _head(endpoint: Endpoint, body: Mapping[str, Any]) -> ChainLink:
    shaping = {name: body[name] for name in PROMPT_SHAPING if body.get(name) is not None}
    shaping["endpoint"] = str(endpoint)
    text = _canonical(shaping)
    tool_chars = len(_canonical(body["tools"])) if body.get("tools") else 0  # tools are rendered into the prompt
    return ChainLink(_digest(b"kvpush-conversation-v1", text), tool_chars)


def _message_link(previous: ChainLink, message: Any) -> ChainLink:
    return ChainLink(
        _digest(previous.digest, _canonical(_normalised(message))), previous.chars + _message_chars(message)
    )


def _text_chain(endpoint: Endpoint, links: Sequence[ChainLink], text: str, chunk_chars: int) -> Chain:
    out = list(links)
    whole = len(text) - len(text) % chunk_chars
    for start in range(0, whole, chunk_chars):
        piece = text[start : start + chunk_chars]
        out.append(ChainLink(_digest(out[-1].digest, piece), out[-1].chars + len(piece)))
    return Chain(endpoint, tuple(out), chunk_chars, text[whole:])


def _answer_message(answer: str) -> dict[str, Any]:
    return {"role": "assistant", "content": answer}


def _normalised(message: Any) -> Any:
    """A message with absent-equivalent fields dropped (None values), so a client that echoes the answer as the
    official SDKs do (`"tool_calls": null`, `"refusal": null`) still matches. Everything else counts."""
    if not isinstance(message, Mapping):
        return message
    return {key: value for key, value in message.items() if value is not None}


def _message_chars(message: Any) -> int:
    if not isinstance(message, Mapping):
        return MESSAGE_OVERHEAD_CHARS
    content = message.get("content")
    chars = MESSAGE_OVERHEAD_CHARS
    if isinstance(content, str):
        chars += len(content)
    elif isinstance(content, list):
        chars += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, Mapping))
    if message.get("tool_calls"):
        chars += len(_canonical(message["tool_calls"]))
    return chars


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _digest(previous: bytes, text: str) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()
