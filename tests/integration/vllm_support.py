"""Shared helpers for tests on real vLLM CPU processes: engine families, router processes, prompts, requests.

Processes start through `stack` (`stack.family`, `stack.routers`); `started()` runs one P/D family and records
each engine's idle KV usage, which `wait_idle()` checks against. The bounded wait, the /metrics reader and the
paths come from tests/integration/support.py and are re-exported here under their old names.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from stack.engines import Engine, Fleet
from stack.family import PdFamily, start_family
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
    "SETTLE",
    "STARTUP_TIMEOUT",
    "Engines",
    "Result",
    "complete",
    "is_idle",
    "kv_sources",
    "metric",
    "path_of",
    "prompt_text",
    "request_body",
    "require_vllm",
    "router",
    "started",
    "timing",
    "tiny_model",
    "wait_for",
    "wait_idle",
]

MODEL = "tiny"
SETTLE = 30.0  # seconds an engine gets to reflect a finished or aborted request in its metrics
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Engines:
    """The started engines of one P/D family (one decode), and each engine's KV cache usage when idle."""

    prefills: list[Engine]
    decode: Engine
    fleet: Fleet
    idle_usage: dict[str, float] = field(default_factory=dict)  # url -> kv_cache_usage_perc when idle

    def members(self) -> list[Engine]:
        return [*self.prefills, self.decode]

    def urls(self) -> list[str]:
        return [e.url for e in self.members()]


@contextlib.contextmanager
def started(family: PdFamily) -> Iterator[Engines]:
    """Every engine of `family` started at once under one Fleet (stopped when the block ends), idle usage read; they
    start on both cores, each pinned to its own once ready (stack.engines, spread start)."""
    with Fleet(LOGS, spread_start=True) as fleet:
        pd = start_family(fleet, family, STARTUP_TIMEOUT)
        engines = Engines(list(pd.prefills), pd.decode, fleet)
        engines.idle_usage = {url: metric(url, "vllm:kv_cache_usage_perc") for url in engines.urls()}
        yield engines


def load(url: str) -> dict[str, float]:
    return {name: metric(url, name) for name in (*BUSY, "vllm:kv_cache_usage_perc")}


def is_idle(engines: Engines, url: str) -> bool:
    now = load(url)
    return not any(now[name] for name in BUSY) and now["vllm:kv_cache_usage_perc"] <= engines.idle_usage[url]


def _idle_message(engines: Engines, what: str, url: str) -> str:
    return f"{what}: {url} idle (now {load(url)}, idle KV usage {engines.idle_usage[url]})"


def wait_idle(engines: Engines, urls: Sequence[str], what: str) -> None:
    """Every engine in `urls` runs nothing, queues nothing and holds no more KV blocks than when idle."""
    for url in urls:
        wait_for(partial(is_idle, engines, url), partial(_idle_message, engines, what, url), timeout=SETTLE)


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


def push_replicas(
    routers: Fleet, prefill: Engine, decode: Engine, config: Path, label: str, count: int = 2
) -> list[str]:
    """`count` router processes in push mode over one prefill and one decode, each reading `config` (the replicas
    of a test that follows the engines' KV events); their base URLs once each is healthy."""
    urls = []
    for i in range(count):
        port = free_port()
        spec = router_spec(
            port,
            "push",
            [prefill.engine_spec.prefill_arg()],
            [decode.url],
            "--health-interval",
            "0.5",
            config=config,
            name=f"router-{label}{i}-{port}",
        )
        router = routers.start(Router(spec, log_dir=LOGS))
        router.wait_healthy(60.0)
        urls.append(router.url)
    return urls


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
