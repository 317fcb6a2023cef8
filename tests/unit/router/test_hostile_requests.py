"""Hostile and malformed requests through the ASGI app (no sockets), stand-in workers behind MockTransport.

Issue 10's client-side and correctness bugs, each as a test of the behaviour the fixes must have. The raw ASGI
driver (`drive`) controls what the router's `receive` sees (chunking, stalls, headers as sent on the wire) and
what its `send` does (a client that stops reading), which httpx.ASGITransport cannot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from router.admission import Admission
from router.app import create_app
from router.config import build_settings
from router.errors import ConfigError, Overloaded
from router.metrics import Metrics
from router.service import Service
from tests.unit.router.fake_workers import FakeWorkers, Handler, decode_ok, prefill_ok, status

P0 = "http://p0:8100,engine_id=p0,side_port=5600"
P1 = "http://p1:8100,engine_id=p1,side_port=5601"
BASE: dict[str, Any] = {"prefill": [P0], "decode": ["http://d0:8200"]}
OK_BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
GUARD = 10.0  # hang guard for one driven request, seconds; never a speed assertion

Message = dict[str, Any]


# ---------------------------------------------------------------------------------------------------- the driver


@dataclass
class Reply:
    """What the router sent back for one driven request."""

    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    raised: BaseException | None = None  # an exception out of the app: uvicorn would log a traceback

    def header(self, name: str) -> str | None:
        values = [v.decode("latin-1") for k, v in self.headers if k.decode("latin-1").lower() == name]
        return values[-1] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


def is_openai_error(reply: Reply, status: int | None = None) -> bool:
    """An OpenAI-style error: JSON `{"error": {"message": str, "type": str, "code": ...}}`, right status."""
    if status is not None and reply.status != status:
        return False
    if not (reply.header("content-type") or "").startswith("application/json"):
        return False
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


async def drive(
    app: FastAPI,
    method: str,
    path: str,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    chunks: Sequence[bytes] = (),
    query: bytes = b"",
    stall_after: int | None = None,
    release: asyncio.Event | None = None,
    send_blocks: asyncio.Event | None = None,
    guard: float = GUARD,
) -> Reply:
    """One request through the app. `stall_after=k`: receive blocks after k chunks until `release` is set.
    `send_blocks`: once the response has started, every body send blocks until that event is set (a client
    that stops reading). Body messages are sent exactly as chunked; after the last, receive waits for the end
    of the response and then reports http.disconnect."""
    reply = Reply()
    finished = asyncio.Event()
    sent = 0

    async def receive() -> Message:
        nonlocal sent
        if stall_after is not None and sent == stall_after and release is not None:
            await release.wait()
        if sent < len(chunks) or (sent == 0 and not chunks):
            body = chunks[sent] if chunks else b""
            sent += 1
            return {"type": "http.request", "body": body, "more_body": sent < len(chunks)}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            reply.status = int(message["status"])
            reply.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            if send_blocks is not None:
                await send_blocks.wait()
            reply.body += message.get("body", b"")
            if not message.get("more_body", False):
                reply.complete = True
                finished.set()

    scope: Message = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in headers],
        "client": ("127.0.0.1", 50000),
        "server": ("router", 80),
        "state": {},
    }
    try:
        async with asyncio.timeout(guard):
            await app(scope, receive, send)
    except TimeoutError:
        raise AssertionError(f"{method} {path}: no complete answer within the {guard:g} s hang guard") from None
    except Exception as exc:  # noqa: BLE001  # the app let an exception out: a traceback in the server's log
        reply.raised = exc
    finally:
        finished.set()
    return reply


def json_headers(extra: Sequence[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"router"), (b"content-type", b"application/json"), *extra]


async def post(app: FastAPI, body: bytes | Mapping[str, Any], *, path: str = "/v1/completions", **kwargs: Any) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = kwargs.pop("headers", ())
    return await drive(app, "POST", path, headers=json_headers(extra), chunks=[raw], **kwargs)


@asynccontextmanager
async def router(
    handlers: Mapping[str, Handler] | None = None,
    settings: Mapping[str, Any] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> AsyncIterator[tuple[FastAPI, FakeWorkers]]:
    workers = FakeWorkers(dict(handlers or {"p0": prefill_ok(), "d0": decode_ok()}))
    app = create_app(build_settings({**BASE, **(settings or {})}), transport=transport or workers.transport())
    async with app.router.lifespan_context(app):
        yield app, workers


def service_of(app: FastAPI) -> Service:
    """The app's Service (`app.state.service`; `app.state.runtime` before the issue-10 rework)."""
    service = getattr(app.state, "service", None) or getattr(app.state, "runtime", None)
    assert isinstance(service, Service)
    return service


async def metrics_text(app: FastAPI) -> str:
    reply = await drive(app, "GET", "/metrics", headers=[(b"host", b"router")])
    return reply.body.decode()


def counter(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; 0 when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info is not None or r.levelno >= logging.ERROR]


# ---------------------------------------------------------------------------------------------------- limits


async def test_a_body_over_max_body_bytes_is_413_and_never_reaches_a_worker() -> None:
    async with router() as (app, workers):
        prompt = "x" * (17 * 2**20)  # over the 16 MiB default
        raw = json.dumps({**OK_BODY, "prompt": prompt}).encode()
        chunks = [raw[i : i + 2**20] for i in range(0, len(raw), 2**20)]
        reply = await drive(app, "POST", "/v1/completions", headers=json_headers(), chunks=chunks)
        assert is_openai_error(reply, 413), (reply.status, reply.body[:200])
        assert workers.seen == []


async def test_a_declared_content_length_over_the_limit_is_413_before_the_body_is_read() -> None:
    async with router() as (app, workers):
        declared = [(b"content-length", str(200 * 2**20).encode())]
        release = asyncio.Event()  # the body never comes: the router must not wait for it
        reply = await drive(
            app,
            "POST",
            "/v1/completions",
            headers=json_headers(declared),
            chunks=[b"{", b"}"],
            stall_after=0,
            release=release,
            guard=3.0,
        )
        assert is_openai_error(reply, 413), (reply.status, reply.body[:200])
        assert workers.seen == []


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([(b"x-big", b"v" * (33 * 2**10))], id="one-header-over-32KiB"),
        pytest.param([(f"x-h{i}".encode(), b"v" * 2048) for i in range(20)], id="sum-of-headers-over-32KiB"),
        pytest.param([(f"x-h{i}".encode(), b"v") for i in range(101)], id="101-headers"),
    ],
)
async def test_too_large_or_too_many_headers_are_431(extra: list[tuple[bytes, bytes]]) -> None:
    async with router() as (app, workers):
        reply = await post(app, OK_BODY, headers=extra)
        assert is_openai_error(reply, 431), (reply.status, reply.body[:200])
        assert workers.seen == []


@pytest.mark.parametrize(
    "bad_id",
    [
        pytest.param(b"r" * 129, id="129-chars"),
        pytest.param(b"r" * 2**20, id="1MiB"),
        pytest.param(b"has space", id="space"),
        pytest.param(b"<script>alert(1)</script>", id="markup"),
        pytest.param(b"line\x01break", id="control-char"),
        pytest.param(b"caf\xc3\xa9", id="non-ascii"),
    ],
)
async def test_an_unsafe_request_id_is_replaced_not_echoed_logged_or_kept(
    bad_id: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with router() as (app, _):
        for body in (OK_BODY, {"prompt": "no model"}):  # a served request and a refused one
            reply = await post(app, body, headers=[(b"x-request-id", bad_id)])
            assert reply.status in (200, 400, 431)  # 431: the id alone is over max_header_bytes
            echoed = reply.header("x-request-id")
            assert echoed is not None and echoed.encode("latin-1") != bad_id
            assert SAFE_ID.match(echoed), echoed[:200]
        timings = await drive(app, "GET", "/debug/timings", headers=[(b"host", b"router")])
        assert bad_id.decode("latin-1") not in timings.body.decode("latin-1")
    assert not any(bad_id.decode("latin-1") in r.getMessage() for r in caplog.records)


async def test_pins_a_safe_request_id_of_128_chars_is_echoed() -> None:
    """Passes today; pins what the request-id validation must keep."""
    good = "A-z0.9_:" * 16
    async with router() as (app, _):
        reply = await post(app, OK_BODY, headers=[(b"x-request-id", good.encode())])
        assert reply.status == 200 and reply.header("x-request-id") == good


# ---------------------------------------------------------------------------------------------------- bad JSON


PROMPT_FIELD = {
    "/v1/completions": b'"prompt": "hi"',
    "/v1/chat/completions": b'"messages": [{"role": "user", "content": "hi"}]',
}
HOSTILE_FIELDS = [  # each goes next to a valid model and prompt (or messages)
    pytest.param(b'"temperature": NaN', id="NaN"),
    pytest.param(b'"temperature": Infinity', id="Infinity"),
    pytest.param(b'"top_p": -Infinity', id="-Infinity"),
    pytest.param(b'"temperature": 1e999', id="float-overflow"),
    pytest.param(b'"user": "hi \\ud800 there"', id="lone-high-surrogate"),
    pytest.param(b'"stop": ["\\udfff"]', id="lone-low-surrogate"),
    pytest.param(b'"x": ' + b"[" * 500 + b"]" * 500, id="nesting-500"),
    pytest.param(b'"x": ' + b'{"a": ' * 200 + b"1" + b"}" * 200, id="nesting-200-objects"),
    pytest.param(b'"x": ' + b"[" * 100_000 + b"]" * 100_000, id="nesting-100000"),
]


@pytest.mark.parametrize("field", HOSTILE_FIELDS)
@pytest.mark.parametrize("path", sorted(PROMPT_FIELD))
async def test_hostile_json_is_an_openai_400_counted_in_the_metrics(
    field: bytes, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    raw = b'{"model": "tiny", ' + PROMPT_FIELD[path] + b", " + field + b"}"
    async with router() as (app, workers):
        reply = await post(app, raw, path=path)
        assert reply.raised is None, repr(reply.raised)
        assert is_openai_error(reply, 400), (reply.status, reply.body[:300])
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert workers.seen == []
        text = await metrics_text(app)
        assert counter(text, "kvpush_errors_total", kind="bad_request") == 1.0
        assert counter(text, "kvpush_requests_total", outcome="bad_request") == 1.0
    assert tracebacks(caplog) == []


# ---------------------------------------------------------------------------------------------------- error bodies


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [("GET", "/nope", 404), ("POST", "/v2/completions", 404), ("GET", "/v1/completions", 405), ("PUT", "/ready", 405)],
)
async def test_404_and_405_are_openai_shaped(method: str, path: str, code: int) -> None:
    async with router() as (app, _):
        reply = await drive(app, method, path, headers=[(b"host", b"router")])
        assert is_openai_error(reply, code), (reply.status, reply.body[:200])


async def test_an_internal_failure_is_an_openai_shaped_5xx_not_plain_text() -> None:
    workers = FakeWorkers({"p0": prefill_ok()})

    async def broken(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0" and request.url.path != "/health":
            raise RuntimeError("a bug below the transport seam")
        return await workers.transport().handle_async_request(request)

    async with router(transport=httpx.MockTransport(broken)) as (app, _):
        reply = await post(app, OK_BODY)
        assert reply.status is not None and reply.status >= 500
        assert is_openai_error(reply), (reply.status, reply.body[:300])
        assert b"Traceback" not in reply.body and b"RuntimeError" not in reply.body


# ---------------------------------------------------------------------------------------------------- admission


async def test_a_slot_handed_over_as_the_wait_deadline_fires_is_not_leaked() -> None:
    """release() hands the slot to a waiter in the very loop iteration in which its wait deadline fires."""
    admission = Admission(limit=1, queue=1, max_wait=0.05, metrics=Metrics())
    await admission.acquire()
    waiter = asyncio.ensure_future(admission.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    time.sleep(0.1)  # noqa: ASYNC251  # the loop is blocked past the waiter's deadline: its timer is due ...
    asyncio.get_running_loop().call_soon(admission.release)  # ... and runs right after this release
    (outcome,) = await asyncio.gather(waiter, return_exceptions=True)
    if isinstance(outcome, Overloaded):
        assert admission.in_flight == 0, "refused, yet its slot still counts as in flight"
    else:
        assert outcome is None
        admission.release()
        assert admission.in_flight == 0


async def test_a_client_still_sending_its_body_holds_no_admission_slot() -> None:
    async with router(settings={"max_in_flight": 1, "admission_queue": 0}) as (app, _):
        release = asyncio.Event()
        raw = json.dumps(OK_BODY).encode()
        slow = asyncio.ensure_future(
            drive(
                app,
                "POST",
                "/v1/completions",
                headers=json_headers(),
                chunks=[raw[:5], raw[5:]],
                stall_after=1,
                release=release,
            )
        )
        for _ in range(20):
            await asyncio.sleep(0)
        assert not slow.done()
        other = await post(app, OK_BODY)
        assert other.status == 200, (other.status, other.body[:200])
        release.set()
        assert (await slow).status == 200
        assert service_of(app).admission.in_flight == 0


async def test_a_body_that_does_not_arrive_within_client_body_is_408() -> None:
    async with router(settings={"timeouts": {"client_body": 0.2}}) as (app, workers):
        reply = await drive(
            app,
            "POST",
            "/v1/completions",
            headers=json_headers(),
            chunks=[b'{"model": "tiny", ', b'"prompt": "x"}'],
            stall_after=1,
            release=asyncio.Event(),  # never set: the rest of the body never comes
            guard=3.0,
        )
        assert is_openai_error(reply, 408), (reply.status, reply.body[:200])
        assert workers.seen == [] and service_of(app).admission.in_flight == 0


async def test_a_client_that_stops_reading_its_stream_is_cut_and_both_legs_closed() -> None:
    closed = asyncio.Event()
    handlers = {"p0": prefill_ok(), "d0": decode_ok(tokens=1000, closed=closed)}
    async with router(handlers, settings={"timeouts": {"client_write_stall": 0.2}}) as (app, _):
        never = asyncio.Event()  # the client never reads: every body send blocks
        reply = await post(app, {**OK_BODY, "stream": True}, send_blocks=never, guard=3.0)
        assert reply.status == 200 and not reply.complete
        assert closed.is_set(), "the decode leg was closed"
        service = service_of(app)
        assert service.admission.in_flight == 0
        assert all(w["in_flight"] == 0 for w in service.pool.snapshot())


# ---------------------------------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("path", "query"), [("/v1/models", b""), ("/debug/timings", b""), ("/debug/timings", b"request_id=x")]
)
async def test_models_and_timings_need_a_key_when_keys_are_configured(path: str, query: bytes) -> None:
    key = "client-key-0123456789"
    async with router(settings={"api_keys": [key]}) as (app, _):
        for auth in ([], [(b"authorization", b"Bearer wrong-key-0000")]):
            denied = await drive(app, "GET", path, headers=[(b"host", b"router"), *auth], query=query)
            assert is_openai_error(denied, 401), (path, denied.status, denied.body[:200])
        allowed = await drive(
            app, "GET", path, headers=[(b"host", b"router"), (b"authorization", f"Bearer {key}".encode())], query=query
        )
        assert allowed.status == 200


# ---------------------------------------------------------------------------------------------------- correctness


async def test_a_prefill_4xx_caused_by_the_client_is_not_retried() -> None:
    handlers = {
        "p0": status(400, "prompt too long"),
        "p1": status(400, "prompt too long"),
        "d0": decode_ok(kv=asyncio.Event()),  # waits for KV that never comes
        "d1": decode_ok(kv=asyncio.Event()),
    }
    settings = {"prefill": [P0, P1], "decode": ["http://d0:8200", "http://d1:8200"], "retries": 1}
    async with router(handlers, settings) as (app, workers):
        reply = await post(app, OK_BODY)
        assert is_openai_error(reply, 400) and "prompt too long" in reply.json()["error"]["message"]
        prefills = len(workers.legs("p0")) + len(workers.legs("p1"))
        decodes = len(workers.legs("d0")) + len(workers.legs("d1"))
        assert (prefills, decodes <= 1) == (1, True), f"{prefills} prefill and {decodes} decode legs"
        assert counter(await metrics_text(app), "kvpush_retries_total", leg="prefill") == 0.0


async def test_a_decode_4xx_caused_by_the_client_is_not_retried() -> None:
    handlers = {"p0": prefill_ok(), "p1": prefill_ok(), "d0": status(400, "bad logprobs"), "d1": status(400, "bad")}
    settings = {"prefill": [P0, P1], "decode": ["http://d0:8200", "http://d1:8200"], "retries": 1}
    async with router(handlers, settings) as (app, workers):
        reply = await post(app, {**OK_BODY, "stream": True})
        assert is_openai_error(reply, 400), (reply.status, reply.body[:200])
        decodes = len(workers.legs("d0")) + len(workers.legs("d1"))
        prefills = len(workers.legs("p0")) + len(workers.legs("p1"))
        assert (decodes, prefills <= 1) == (1, True), f"{prefills} prefill and {decodes} decode legs"


def _json_to_a_stream() -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield json.dumps({"id": "cmpl-d", "choices": [{"text": "not a stream"}]}).encode()

        return httpx.Response(200, headers={"content-type": "application/json"}, content=chunks())

    return handle


async def test_a_non_sse_answer_to_a_streamed_request_is_not_relayed_as_a_200_stream() -> None:
    async with router({"p0": prefill_ok(), "d0": _json_to_a_stream()}) as (app, _):
        reply = await post(app, {**OK_BODY, "stream": True})
        assert reply.status != 200 and not (reply.header("content-type") or "").startswith("text/event-stream")
        assert is_openai_error(reply, 502), (reply.status, reply.body[:200])


def _endless_event(total: int) -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: " + b"y" * 100
            for _ in range(total // 2**16):
                yield b"z" * 2**16  # no event separator, ever

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    return handle


async def test_a_decode_event_larger_than_max_event_bytes_fails_the_leg() -> None:
    async with router({"p0": prefill_ok(), "d0": _endless_event(9 * 2**20)}) as (app, _):
        reply = await post(app, {**OK_BODY, "stream": True})
        assert is_openai_error(reply, 502), (reply.status, len(reply.body))
        assert len(reply.body) < 2**16


async def test_drain_grace_below_one_second_reaches_the_server_unrounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from router import cli, drain, logs

    seen: list[Any] = []
    monkeypatch.setattr(drain.DrainingServer, "run", lambda self, sockets=None: seen.append(self.config))
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)
    argv = ["--prefill", P0, "--decode", "http://d0:8200", "--drain-grace", "0.9", "--port", "0"]
    assert cli.load_serve_settings(argv, {}).drain_grace == pytest.approx(0.9)
    await asyncio.to_thread(cli.serve, argv)
    assert len(seen) == 1
    assert seen[0].timeout_graceful_shutdown == pytest.approx(0.9)


async def test_admin_add_worker_cannot_smuggle_side_host_through_engine_id() -> None:
    admin = "admin-key-9876543210"
    async with router(settings={"admin_key": admin}) as (app, _):
        body = {"role": "prefill", "url": "http://p9:8100", "engine_id": "e1,side_host=evil.example", "side_port": 5609}
        reply = await post(app, body, path="/admin/workers", headers=[(b"authorization", f"Bearer {admin}".encode())])
        if reply.status == 400:
            assert is_openai_error(reply, 400)
            return
        assert reply.status == 201, (reply.status, reply.body[:200])
        identity = service_of(app).pool.get("http://p9:8100").identity
        assert identity is not None
        assert identity.host != "evil.example" and identity.engine_id == "e1,side_host=evil.example"


@pytest.mark.parametrize(
    "layer",
    [
        pytest.param({"decode": ["http://user:secret@d0:8200"]}, id="decode-flag"),
        pytest.param({"prefill": ["http://user:secret@p0:8100,engine_id=p0,side_port=5600"]}, id="prefill-spec"),
        pytest.param({"prefill": [{"url": "http://u:p@p0:8100"}]}, id="prefill-mapping"),
        pytest.param({"decode": [{"url": "http://:secret@d0:8200"}]}, id="password-only"),
    ],
)
def test_a_worker_url_with_credentials_is_a_config_error(layer: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as refused:
        build_settings({**BASE, **layer})
    assert "secret" not in str(refused.value) and ":p@" not in str(refused.value)


async def test_admin_add_worker_with_credentials_in_the_url_is_refused() -> None:
    admin = "admin-key-9876543210"
    async with router(settings={"admin_key": admin}) as (app, _):
        auth = [(b"authorization", f"Bearer {admin}".encode())]
        for body in (
            {"role": "decode", "url": "http://user:secret@d9:8200"},
            {"role": "prefill", "url": "http://user:secret@p9:8100"},
        ):
            reply = await post(app, body, path="/admin/workers", headers=auth)
            assert is_openai_error(reply, 400), (reply.status, reply.body[:200])
            assert "secret" not in reply.body.decode()
        assert all("secret" not in str(w["url"]) for w in service_of(app).pool.snapshot())


def _refused() -> Handler:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    return handle


ROLE_FAILURES: dict[str, tuple[Callable[[], dict[str, Handler]], str]] = {
    # decode gated on an event nobody sets: it waits for KV, so the prefill failure decides the answer
    "prefill-refuses": (lambda: {"p0": _refused(), "d0": decode_ok(kv=asyncio.Event())}, "prefill"),
    "prefill-500": (lambda: {"p0": status(500, "engine died"), "d0": decode_ok(kv=asyncio.Event())}, "prefill"),
    "decode-500": (lambda: {"p0": prefill_ok(), "d0": status(500, "engine died")}, "decode"),
    "decode-refuses": (lambda: {"p0": prefill_ok(), "d0": _refused()}, "decode"),
}


@pytest.mark.parametrize("case", sorted(ROLE_FAILURES))
@pytest.mark.parametrize("stream", [False, True])
async def test_client_facing_errors_name_the_role_not_the_worker_url(case: str, stream: bool) -> None:
    handlers, role = ROLE_FAILURES[case]
    async with router(handlers(), settings={"retries": 0}) as (app, _):
        reply = await post(app, {**OK_BODY, "stream": stream})
        assert is_openai_error(reply), (reply.status, reply.body[:200])
        message = reply.json()["error"]["message"]
        assert role in message
        for internal in ("http://", "p0:8100", "d0:8200", "//p0", "//d0"):
            assert internal not in message, message


# ---------------------------------------------------------------------------------------------------- loops


async def test_the_health_loop_survives_an_exception_that_is_not_an_httpx_error() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(), "d1": decode_ok()})
    probes = {"d1": 0}

    async def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d1" and request.url.path == "/health":
            probes["d1"] += 1
            if probes["d1"] > 1:  # the first probe (at startup) passes; later ones hit a bug
                raise ValueError("not an httpx error")
        return await workers.transport().handle_async_request(request)

    settings = {"decode": ["http://d0:8200", "http://d1:8200"], "health_interval": 0.05}
    app = create_app(build_settings({**BASE, **settings}), transport=httpx.MockTransport(flaky))
    async with app.router.lifespan_context(app):
        service = service_of(app)

        def healthy(url: str) -> bool:
            return bool({w["url"]: w["healthy"] for w in service.pool.snapshot()}[url])

        async def until(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 5.0  # hang guard
            while not check():
                if time.monotonic() > deadline:
                    raise AssertionError(f"not within the 5 s hang guard: {what}")
                await asyncio.sleep(0.02)

        await until(lambda: probes["d1"] >= 3, "the health loop keeps probing after the exception")
        workers.down.add("d0")
        await until(lambda: not healthy("http://d0:8200"), "d0 marked down")
        workers.down.discard("d0")
        await until(lambda: healthy("http://d0:8200"), "d0 comes back")


async def test_a_background_loop_that_dies_turns_ready_to_503() -> None:
    from router.loops import Supervisor  # interface 3 (router/loops.py)

    async with router() as (app, _):
        assert (await drive(app, "GET", "/ready", headers=[(b"host", b"router")])).status == 200
        supervisors = [v for v in vars(service_of(app)).values() if isinstance(v, Supervisor)]
        assert len(supervisors) == 1, "the service runs its loops under one Supervisor"

        async def ends_at_once() -> None:
            return None  # a background loop must run until cancelled; one that returns is dead

        supervisors[0].spawn("test-loop", ends_at_once)
        deadline = time.monotonic() + 5.0  # hang guard
        while supervisors[0].alive() and time.monotonic() < deadline:  # noqa: ASYNC110  # no event to wait on
            await asyncio.sleep(0.01)
        ready = await drive(app, "GET", "/ready", headers=[(b"host", b"router")])
        assert ready.status == 503, (ready.status, ready.body[:200])
