"""Test support for our connector on real vLLM through the router: engines with per-engine flags, a failing
stand-in prefill, idle checks and both legs sent by hand (as the router would)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from stack.engines import Engine, EngineSpec, Fleet
from stack.procs import free_port
from tests.integration.vllm_support import LOGS, STARTUP_TIMEOUT, metric, tiny_model

CONNECTOR = "KvpushConnector"
MODULE = "connector.plugin"
SETTLE = 30.0  # seconds an engine gets to reflect a finished or aborted request in its metrics
# D's hold deadline for one registration (kv_connector_extra_config): a request failed by link loss keeps its
# blocks (quarantine, guarantee G2) this long. Shorter than the default 120 s so a test can watch it end.
KV_TIMEOUT_S = 45.0
CONNECTOR_EXTRA = {"kv_timeout_s": KV_TIMEOUT_S}
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class Member:
    """One engine to start: its role and the vLLM flags it gets beyond the launcher's."""

    role: str  # "prefill" or "decode"
    extra_args: tuple[str, ...] = ()


@dataclass
class Engines:
    """Started engines of one family, our connector on each; one decode."""

    prefills: list[Engine]
    decode: Engine
    fleet: Fleet
    idle_usage: dict[str, float] = field(default_factory=dict)  # url -> kv_cache_usage_perc when idle

    def prefill_spec(self, index: int) -> str:
        """The router's --prefill value naming this prefill's NIXL identity."""
        spec = self.prefills[index].engine_spec
        return f"{spec.url},engine_id={spec.engine_id},side_port={spec.side_port}"

    def urls(self) -> list[str]:
        return [e.url for e in (*self.prefills, self.decode)]


@contextlib.contextmanager
def kvpush_engines(members: Sequence[Member], tag: str) -> Iterator[Engines]:
    """Prefills on core 0, the decode on core 1, all started at once; stopped when the block ends."""
    model = tiny_model()
    specs, n = [], 0
    for m in members:
        name = f"{tag}-d" if m.role == "decode" else f"{tag}-p{n}"
        n += m.role == "prefill"
        engine_id = f"{name}-{uuid.uuid4().hex[:6]}"
        specs.append(
            EngineSpec(
                name=name,
                role=m.role,  # type: ignore[arg-type]  # "prefill" or "decode"
                model=model,
                core=1 if m.role == "decode" else 0,
                side_port=free_port(),
                connector=CONNECTOR,
                connector_module=MODULE,
                engine_id=engine_id,
                extra_args=m.extra_args,
                connector_extra=CONNECTOR_EXTRA,
            )
        )
    with Fleet(LOGS) as fleet:
        started = fleet.start_all(specs)
        fleet.wait_all_healthy(STARTUP_TIMEOUT)
        decode = next(e for e, m in zip(started, members, strict=True) if m.role == "decode")
        prefills = [e for e, m in zip(started, members, strict=True) if m.role == "prefill"]
        engines = Engines(prefills, decode, fleet)
        engines.idle_usage = {url: metric(url, "vllm:kv_cache_usage_perc") for url in engines.urls()}
        yield engines


def wait_for(
    predicate: Callable[[], bool], what: str | Callable[[], str], timeout: float = SETTLE, interval: float = 0.2
) -> None:
    """Polls until `predicate()` holds: a bounded wait for a state, not a speed assertion. `what` may be a
    callable, asked only on failure (to describe the state then)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what if isinstance(what, str) else what()}: not reached within {timeout:g} s")
        time.sleep(interval)


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
        wait_for(
            partial(is_idle, engines, url),
            partial(_idle_message, engines, what, url),
        )


def decode_params(engines: Engines, prefill: int, request_id: str, transfer_id: str) -> dict[str, Any]:
    spec = engines.prefills[prefill].engine_spec
    return {
        "do_remote_prefill": True,
        "remote_engine_id": spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": spec.side_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return dict(
        body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id}
    )


def post(url: str, body: dict[str, Any], request_id: str, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=timeout)


def push(engines: Engines, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """Both legs straight to p0 and the decode at once, same X-Request-Id and transfer id, as the router does."""
    rid, tid = f"kvp-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(2) as pool:
        d_body = dict(body, kv_transfer_params=decode_params(engines, 0, rid, tid))
        d_leg = pool.submit(post, engines.decode.url, d_body, rid)
        p_leg = pool.submit(post, engines.prefills[0].url, prefill_body(body, tid), rid)
        return p_leg.result(), d_leg.result()


@dataclass
class StreamEnd:
    """How a streamed decode answer ended."""

    status: int
    events: list[dict[str, Any]]
    seconds: float  # from `started()` to the end of the answer
    other: list[str] = field(default_factory=list)  # non-event lines (an error body)
    error: str | None = None  # transport error, if the connection broke instead

    @property
    def text(self) -> str:
        return "".join(c.get("text") or "" for e in self.events for c in e.get("choices") or [])

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices") or [] if c.get("finish_reason")]


class FailingPrefill:
    """A stand-in prefill worker: healthy, but every completion gets HTTP 503 after `delay` s.

    Given a real prefill's NIXL identity in the router's --prefill spec, a decode leg paired with it really
    registers with that prefill's connector; only the prefill leg fails, so the router retries with fresh ids.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
                self._reply(200, body if self.path == "/v1/models" else b"")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.calls += 1
                time.sleep(outer.delay)
                self._reply(503, json.dumps({"error": {"message": "stand-in prefill refuses"}}).encode())

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="failing-prefill", daemon=True)

    def __enter__(self) -> FailingPrefill:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def read_stream(
    client: httpx.Client, url: str, body: dict[str, Any], request_id: str, started: Callable[[], float]
) -> StreamEnd:
    """POST a streamed request and read it to its end; `started()` is when the clock for `seconds` began."""
    events: list[dict[str, Any]] = []
    other: list[str] = []
    try:
        with client.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                elif line.strip() and line != "data: [DONE]":
                    other.append(line)
            return StreamEnd(response.status_code, events, time.monotonic() - started(), other)
    except httpx.TransportError as exc:
        return StreamEnd(0, events, time.monotonic() - started(), other, error=repr(exc))
