"""Streaming OpenAI client for one request: builds the body, reads SSE, times chunks into a ClientRecord."""

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.records import ClientRecord

Clock = Callable[[], float]
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestSpec:
    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str
    max_tokens: int
    ignore_eos: bool = True


def payload(spec: RequestSpec) -> dict[str, Any]:
    """The request body: streamed with usage, greedy, fixed output length."""
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": spec.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.max_tokens
    elif spec.endpoint == "completions":
        body["prompt"] = spec.prompt
    else:
        raise ValueError(f"unknown endpoint {spec.endpoint!r}")
    return body


def chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    return str(delta.get("content") or "")


class StreamTracker:
    """Pure SSE bookkeeping: feed it each line with the time it arrived; it fills the record."""

    def __init__(self, rec: ClientRecord, t_send: float):
        self.rec = rec
        self._t0 = t_send
        self._last: float | None = None
        self.done = False

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments and other SSE fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        choices = event.get("choices")
        if choices:
            self._on_choice(choices[0], now)
        usage = event.get("usage")
        if usage:
            self.rec.output_tokens = usage.get("completion_tokens")
            self.rec.prompt_tokens = usage.get("prompt_tokens")

    def _on_choice(self, choice: dict[str, Any], now: float) -> None:
        rec = self.rec
        rec.chunks += 1
        if rec.ttft_s is None:
            rec.ttft_s = now - self._t0
        elif self._last is not None:
            rec.itl_s.append(now - self._last)
        if rec.ttft_text_s is None and chunk_text(choice):
            rec.ttft_text_s = now - self._t0
        self._last = now
        rec.e2e_s = now - self._t0

    def finish(self, expect_output: int | None) -> ClientRecord:
        rec = self.rec
        if rec.error is not None:
            rec.ok = False
        elif rec.ttft_s is None:
            rec.error = "no output chunk"
        elif rec.output_tokens is None:
            rec.error = "no usage chunk"
        elif expect_output is not None and rec.output_tokens != expect_output:
            rec.error = f"completion_tokens {rec.output_tokens} != {expect_output}"
        else:
            rec.ok = True
        return rec


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: ClientRecord,
    clock: Clock,
    timeout_s: float,
    expect_output: int | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    listen: Callable[[str], None] | None = None,
) -> ClientRecord:
    """POST one streamed request; never raises for request failures, they land in `rec.error`.

    `headers` go with x-request-id (theirs wins); `listen` also reads every SSE line (the caller's own fields:
    multiturn's answer text and cached tokens); a bad line there is a bad stream like one here.
    """
    t0 = clock()
    tracker = StreamTracker(rec, t0)
    headers = {"x-request-id": rec.request_id, **(headers or {})}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as resp:
                rec.status = resp.status_code
                rec.request_id = resp.headers.get("x-request-id", rec.request_id)
                rec.pairing_id = resp.headers.get("x-kvpush-pairing-id")
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status_code}: {text}"
                else:
                    async for line in resp.aiter_lines():
                        tracker.feed(line, clock())
                        if listen is not None:
                            listen(line)
                        if tracker.done:
                            break
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:.0f}s"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        rec.error = f"bad stream: {exc}"
    return tracker.finish(expect_output)
