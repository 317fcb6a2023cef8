"""Shared helpers for tests on real vLLM CPU processes: engine families, router processes, prompts, requests.

Processes start through `stack` (`stack.engines.pd_family`, `stack.routers`); the bounded wait, the /metrics
reader and the paths come from tests/integration/support.py and are re-exported here under their old names.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from stack.engines import Engine, Fleet
from stack.family import pd_family, start_family
from stack.procs import free_port
from stack.routers import Router, router_spec
from tests.integration.support import (
    CACHE,
    LOGS,
    REPO,
    STARTUP_TIMEOUT,
    metric,
    require_vllm,
    tiny_model,
    wait_for,
)

__all__ = [
    "CACHE",
    "LOGS",
    "MODEL",
    "REPO",
    "STARTUP_TIMEOUT",
    "Pair",
    "Result",
    "complete",
    "kv_sources",
    "metric",
    "pair",
    "path_of",
    "prompt_text",
    "request_body",
    "require_vllm",
    "router",
    "timing",
    "tiny_model",
    "wait_for",
]

MODEL = "tiny"


@dataclass
class Pair:
    """Prefill engines and one decode engine of one connector family, started together."""

    fleet: Fleet
    prefills: list[Engine]
    decode: Engine
    connector: str

    def prefill_spec(self, index: int = 0) -> str:
        """The router's --prefill SPEC naming prefill `index`'s NIXL identity."""
        return self.prefills[index].engine_spec.prefill_arg()


@contextlib.contextmanager
def pair(connector: str, n_prefill: int = 1, module: str | None = None, tag: str = "") -> Iterator[Pair]:
    """One decode (core 1) and `n_prefill` prefill engines (core 0), each its own engine id and side channel."""
    family = pd_family(
        tag or connector.lower(),
        tiny_model(),
        connector,
        module=module,
        n_prefill=n_prefill,
        engine_suffix=f"-{uuid.uuid4().hex[:6]}",
    )
    with Fleet(LOGS) as fleet:
        engines = start_family(fleet, family, STARTUP_TIMEOUT)
        yield Pair(fleet=fleet, prefills=list(engines.prefills), decode=engines.decode, connector=connector)


@contextlib.contextmanager
def router(mode: str, prefills: Sequence[str], decodes: Sequence[str], *extra: str) -> Iterator[str]:
    """A real router process on a free port (health checks every 0.5 s); yields its base URL once /ready."""
    port = free_port()
    spec = router_spec(port, mode, prefills, decodes, "--health-interval", "0.5", *extra, name=f"router-{mode}-{port}")
    proc = Router(spec, log_dir=LOGS)
    proc.start()
    try:
        proc.wait_healthy(60.0)
        yield proc.url
    finally:
        proc.stop(10.0)


def kv_sources(decode_url: str) -> dict[str, float]:
    return {
        source: metric(decode_url, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
    }


def prompt_text(words: int = 60) -> str:
    """A prompt no engine has seen (unique first characters: no prefix-cache hit flatters a mode)."""
    body = " ".join(f"def f{i}(x): return x * {i}" for i in range(words))
    return f"# {uuid.uuid4().hex}\n{body}"


def request_body(endpoint: str, stream: bool, max_tokens: int = 12) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "completions":
        body["prompt"] = prompt_text()
    else:
        body["messages"] = [{"role": "user", "content": prompt_text()}]
    return body


def path_of(endpoint: str) -> str:
    return "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"


@dataclass
class Result:
    status: int
    text: str
    prompt_tokens: int
    headers: httpx.Headers
    events: int


def complete(base_url: str, endpoint: str, body: dict[str, Any], timeout: float = 120.0) -> Result:
    """One request; streams are read event by event and their text pieces joined."""
    url = f"{base_url}{path_of(endpoint)}"
    with httpx.Client(timeout=timeout) as client, client.stream("POST", url, json=body) as response:
        if not body.get("stream"):
            data = json.loads(response.read())
            if response.status_code != 200:
                return Result(response.status_code, json.dumps(data), 0, response.headers, 0)
            choice = data["choices"][0]
            text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
            return Result(200, text, data["usage"]["prompt_tokens"], response.headers, 0)
        pieces, usage, events = [], None, 0
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
                pieces.append(piece or "")
        return Result(
            response.status_code, "".join(pieces), (usage or {}).get("prompt_tokens", 0), response.headers, events
        )


def timing(router_url: str, pairing_id: str) -> dict[str, Any]:
    records = httpx.get(f"{router_url}/debug/timings", params={"pairing_id": pairing_id}, timeout=10).json()
    (record,) = records["requests"]
    return dict(record)
