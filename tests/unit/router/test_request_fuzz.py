"""A request fuzzer (issue 10): hypothesis over JSON bodies, headers and chunking, through the ASGI app.

Stand-in workers answer every leg correctly, so nothing the router answers may be a 5xx: every answer is a
200 or an OpenAI-shaped 4xx, the app never lets an exception out (a traceback in uvicorn's log), nothing is
logged at ERROR or with a traceback, and no counter is left held afterwards.

Deterministic by default (same examples every run, so `make test` cannot flake); `KVPUSH_FUZZ=N` runs N
random examples per test instead, to look for new failures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import create_app
from router.config import build_settings
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, prefill_ok
from tests.unit.router.test_hostile_requests import BASE, Reply, drive, is_openai_error, service_of

_RANDOM = int(os.environ.get("KVPUSH_FUZZ", "0"))
FUZZ = settings(
    max_examples=_RANDOM or 100,
    derandomize=not _RANDOM,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GUARD = 5.0  # hang guard per example (no example waits on a deadline: bodies always end)

# ---------------------------------------------------------------------------------------------------- strategies

SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udbffb", "\udc00\ud800"])
TEXT = st.one_of(st.text(max_size=30), SURROGATES)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]), "content": st.one_of(TEXT, JSON_VALUES)}
    ),
    max_size=3,
)
OPTIONAL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("tiny"), JSON_VALUES),
    "prompt": st.one_of(TEXT, st.lists(st.integers(-5, 2**40), max_size=5), JSON_VALUES),
    "messages": st.one_of(MESSAGES, JSON_VALUES),
    "stream": st.one_of(st.booleans(), JSON_VALUES),
    "max_tokens": st.one_of(st.integers(-3, 2**64), JSON_VALUES),
    "max_completion_tokens": st.one_of(st.integers(-3, 50), JSON_VALUES),
    "n": st.one_of(st.integers(0, 3), JSON_VALUES),
    "best_of": st.one_of(st.integers(0, 3), st.none()),
    "stream_options": st.one_of(st.just({"include_usage": True}), JSON_VALUES),
    "kv_transfer_params": JSON_VALUES,
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), JSON_VALUES),
    "stop": JSON_VALUES,
    "user": TEXT,
}
BODIES = st.fixed_dictionaries(
    {}, optional={**OPTIONAL_FIELDS, "extra": st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3)}
)


def _dumps(body: dict[str, Any]) -> bytes:
    """Python's json writes NaN/Infinity and escapes lone surrogates: both are in the fuzzed bytes."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["json", "json", "json", "mutated", "bytes", "nested", "valid"]))
    if kind == "valid":
        prompt = draw(st.one_of(st.just({"prompt": "hi"}), st.just({"messages": [{"role": "user", "content": "hi"}]})))
        return _dumps({"model": "tiny", "max_tokens": 3, "stream": draw(st.booleans()), **prompt})
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "nested":
        depth = draw(st.integers(1, 3000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        tail = b"1" if opener != b"[" else b""
        return b'{"model": "tiny", "prompt": "hi", "x": ' + opener * depth + tail + closer * depth + b"}"
    raw = _dumps(draw(BODIES))
    if kind == "mutated" and raw:
        at = draw(st.integers(0, len(raw)))
        how = draw(st.sampled_from(["truncate", "insert", "nan", "dup-key", "bom"]))
        if how == "truncate":
            raw = raw[:at]
        elif how == "insert":
            raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
        elif how == "nan":
            raw = raw[:-1] + b', "z": ' + draw(st.sampled_from([b"NaN", b"-Infinity", b"1e999", b"-0"])) + b"}"
        elif how == "dup-key":
            raw = raw[:-1] + b', "model": 7}'
        else:
            raw = b"\xef\xbb\xbf" + raw
    return raw


HEADER_NAMES = st.one_of(
    st.sampled_from(
        [b"x-request-id", b"authorization", b"content-type", b"content-length", b"accept", b"x-kvpush-pairing-id"]
    ),
    st.from_regex(rb"\A[a-z0-9-]{1,24}\Z"),
)
HEADER_VALUES = st.one_of(
    st.binary(max_size=60).map(lambda v: v.replace(b"\r", b"").replace(b"\n", b"").replace(b"\x00", b"")),
    st.from_regex(rb"\A[A-Za-z0-9._:-]{1,140}\Z"),
    st.integers(1, 80).map(lambda k: b"v" * (k * 1024)),  # up to 80 KiB: over the 32 KiB limit sometimes
)
HEADERS = st.one_of(
    st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=8),
    st.integers(90, 130).map(lambda n: [(f"x-h{i}".encode(), b"1") for i in range(n)]),  # around max_headers
)


@st.composite
def chunkings(draw: st.DrawFn, raw: bytes) -> list[bytes]:
    """The body cut into pieces as a client's packets might arrive, empty pieces included."""
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=6)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    return pieces or [b""]


class Logged(logging.Handler):
    """Collects every record at ERROR or above, or carrying a traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is not None or record.levelno >= logging.ERROR:
            self.bad.append(f"{record.levelname} {record.name}: {record.getMessage()}")


# ---------------------------------------------------------------------------------------------------- the checks


def run_one(method: str, path: str, headers: Sequence[tuple[bytes, bytes]], chunks: list[bytes]) -> Reply:
    """One request through a fresh app (a fresh loop, fresh counters), with every check on its answer."""
    handler = Logged()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        reply = asyncio.run(_one(method, path, headers, chunks))
    finally:
        root.removeHandler(handler)
    assert reply.raised is None, f"the app let out {reply.raised!r}"
    assert reply.status is not None and reply.complete, "no complete answer"
    assert handler.bad == [], handler.bad
    if reply.status != 200:
        assert 400 <= reply.status < 500, (reply.status, reply.body[:300])
        assert is_openai_error(reply), (reply.status, reply.body[:300])
    return reply


async def _one(method: str, path: str, headers: Sequence[tuple[bytes, bytes]], chunks: list[bytes]) -> Reply:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    app = create_app(build_settings(BASE), transport=workers.transport())
    async with app.router.lifespan_context(app):
        reply = await drive(app, method, path, headers=[(b"host", b"router"), *headers], chunks=chunks, guard=GUARD)
        service = service_of(app)
        for _ in range(5):  # let a relayed stream's cleanup finish
            await asyncio.sleep(0)
        assert service.admission.in_flight == 0, "an admission slot is left held"
        assert all(w["in_flight"] == 0 for w in service.pool.snapshot()), service.pool.snapshot()
    return reply


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    raw=raw_bodies(),
    headers=HEADERS,
    data=st.data(),
)
def test_fuzzed_completion_requests_get_a_200_or_an_openai_4xx(
    path: str, raw: bytes, headers: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    chunks = data.draw(chunkings(raw))
    reply = run_one("POST", path, headers, chunks)
    if reply.status == 200:
        kind = reply.header("content-type") or ""
        assert kind.startswith("text/event-stream") or kind.startswith("application/json"), kind
    rid = reply.header("x-request-id")
    assert rid is None or (len(rid) <= 128 and all(c.isalnum() or c in "._:-" for c in rid)), rid[:200]


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),  # HEAD answers have no body
    path=st.one_of(
        st.sampled_from(
            ["/v1/models", "/health", "/ready", "/metrics", "/debug/timings", "/admin/workers", "/v1/completions"]
        ),
        st.from_regex(r"\A/[a-z0-9/._-]{0,30}\Z"),
    ),
    raw=st.one_of(st.just(b""), raw_bodies()),
    headers=HEADERS,
)
def test_fuzzed_requests_to_any_route_get_a_200_or_an_openai_4xx(
    method: str, path: str, raw: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    run_one(method, path, headers, [raw])
