"""Batched prompts in /v1/completions, merged as vLLM merges them. Pure.

The router splits a batch into one ordinary request per prompt (`sub_body`: each its own P/D pair, pairing id,
retry and deadline: router/fanout.py), and merges the answers: choice k of prompt i gets index i·n + k; the
usage is summed (prompt tokens per prompt, completion tokens per choice, cached tokens per prompt: exact, where
vLLM reports one prompt's); the merged answer's `id`, `created`, `model` come from prompt 0's answer. A stream
keeps every event as its prompt sent it, re-indexed, under prompt 0's id; each prompt's usage-only event is held
and summed into one, sent last (when the client asked for usage); one `[DONE]` ends it.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"
_SUMMED = ("prompt_tokens", "completion_tokens", "total_tokens")


def sub_body(body: dict[str, Any], prompt: Any) -> dict[str, Any]:
    """Prompt `prompt`'s own request: the client's body with that one prompt."""
    return {**body, "prompt": prompt}


def merge_json(answers: list[bytes], n: int) -> bytes:
    """Whole JSON answers, one per prompt in prompt order, as one answer."""
    parsed = [_decode(a) for a in answers]
    merged = {k: v for k, v in parsed[0].items() if k not in ("kv_transfer_params", "metrics")}
    choices = []
    for i, answer in enumerate(parsed):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": i * n + int(choice.get("index", 0))})
    merged["choices"] = choices
    usages = [a["usage"] for a in parsed if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = sum_usage(usages)
    return _encode(merged)


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise sums; `prompt_tokens_details.cached_tokens` summed when every prompt states it, else null."""
    out = dict(usages[0])
    for key in _SUMMED:
        values = [u.get(key) for u in usages]
        if all(isinstance(v, int) for v in values):
            out[key] = sum(values)
    details = [u.get("prompt_tokens_details") for u in usages]
    cached = [d.get("cached_tokens") if isinstance(d, dict) else None for d in details]
    if all(isinstance(c, int) for c in cached):
        out["prompt_tokens_details"] = {**(details[0] or {}), "cached_tokens": sum(cached)}
    elif "prompt_tokens_details" in out:
        out["prompt_tokens_details"] = None
    return out


class StreamMerge:
    """The events of `count` prompt streams, interleaved as they come, as one stream."""

    def __init__(self, count: int, n: int) -> None:
        self._n = n
        self._id: Any = None
        self._usages: list[dict[str, Any] | None] = [None] * count
        self._template: dict[str, Any] | None = None

    def event(self, prompt: int, event: bytes) -> bytes:
        """What to relay for one whole event of prompt `prompt`'s stream (b"": nothing)."""
        if not event.startswith(b"data:"):
            return event  # comments and other fields pass as they are
        data = event[5:].strip()
        if data == b"[DONE]":
            return b""
        try:
            payload = _decode(data)
        except (msgspec.DecodeError, ValueError):
            return event
        if not isinstance(payload, dict) or "error" in payload:
            return event
        if self._id is None:
            self._id = payload.get("id")
        choices = payload.get("choices")
        if choices == [] and isinstance(payload.get("usage"), dict):
            self._usages[prompt] = payload["usage"]
            self._template = payload
            return b""
        payload["id"] = self._id
        if isinstance(choices, list):
            offset = prompt * self._n
            payload["choices"] = [
                {**c, "index": offset + int(c.get("index", 0))} if isinstance(c, dict) else c for c in choices
            ]
        return b"data: " + _encode(payload) + b"\n\n"

    def end(self) -> bytes:
        """The summed usage event (when every prompt sent one), then `[DONE]`."""
        usages = [u for u in self._usages if u is not None]
        if self._template is None or len(usages) != len(self._usages):
            return DONE
        last = {**self._template, "id": self._id, "usage": sum_usage(usages)}
        return b"data: " + _encode(last) + b"\n\n" + DONE
