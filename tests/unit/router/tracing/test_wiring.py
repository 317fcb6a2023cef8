"""Tracing wired into the router, through ASGI (no sockets): the settings from YAML, KVPUSH_TRACING and flags; the
client's context reaching both legs and bounded like any header; nothing traced or sent with tracing off; a 429
ends its span; the TTFT and handoff exemplars in the OpenMetrics exposition, and none in the plain text one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.cli import load_serve_settings
from router.config import build_settings
from router.errors import ConfigError
from router.tracing import semconv
from router.tracing.provider import Tracing
from router.tracing.settings import TracingSettings
from tests.unit.router.fake_workers import FakeWorkers, decode_ok, prefill_ok
from tests.unit.router.tracing.support import by_name, in_memory

SETTINGS: dict[str, Any] = {"prefill": ["http://p0:8100,engine_id=p0,side_port=5600"], "decode": ["http://d0:8200"]}
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE}-b7ad6b7169203331-01"
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
ARGS = ["--prefill", "http://p0:8100", "--decode", "http://d0:8200"]


def test_tracing_is_off_unless_asked() -> None:
    assert load_serve_settings(ARGS, {}).tracing == TracingSettings()


def test_flags_env_and_yaml_layer_as_every_setting(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("tracing: {endpoint: 'http://collector:4317', sample_ratio: 0.5}\n")
    from_file = load_serve_settings([*ARGS, "--config", str(config)], {})
    assert from_file.tracing == TracingSettings(True, "http://collector:4317", None, 0.5, None)
    off_by_env = load_serve_settings([*ARGS, "--config", str(config)], {"KVPUSH_TRACING": "false"})
    assert off_by_env.tracing.enabled is False and off_by_env.tracing.endpoint == "http://collector:4317"
    flags = ["--otlp-traces-endpoint", "http://other:4318", "--otlp-traces-protocol", "http/protobuf"]
    by_flags = load_serve_settings([*ARGS, "--config", str(config), *flags, "--trace-sample-ratio", "1"], {})
    assert by_flags.tracing == TracingSettings(True, "http://other:4318", "http/protobuf", 1.0, None)
    assert load_serve_settings([*ARGS, "--tracing"], {"KVPUSH_TRACING": "false"}).tracing.enabled is True
    assert load_serve_settings([*ARGS, "--no-tracing", *flags], {}).tracing.enabled is False
    assert load_serve_settings(ARGS, {"KVPUSH_TRACING": "true"}).tracing.enabled is True


def test_bad_tracing_settings_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        build_settings(SETTINGS, {"tracing": {"sample_ratio": 2}})
    with pytest.raises(ConfigError, match="tracing"):
        load_serve_settings(ARGS, {"KVPUSH_TRACING": "sometimes"})


async def serving(workers: FakeWorkers, tracing: Tracing | None, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(build_settings(SETTINGS, settings), transport=workers.transport(), tracing=tracing)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


async def test_the_client_context_reaches_both_legs_under_the_router_s_spans() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    async for c in serving(workers, tracing):
        response = await c.post(
            "/v1/completions", json=BODY, headers={"traceparent": PARENT, "baggage": "tenant=a", "x-request-id": "r7"}
        )
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    spans = by_name(exported.get_finished_spans())
    (server,) = spans["text_completion tiny"]
    assert server.context is not None and f"{server.context.trace_id:032x}" == TRACE
    assert dict(server.attributes or {})[semconv.REQUEST_ID] == "r7"
    for host in ("p0", "d0"):
        (seen,) = workers.legs(host)
        assert seen.headers["traceparent"].startswith(f"00-{TRACE}-") and seen.headers["baggage"] == "tenant=a"


async def test_with_tracing_off_nothing_is_traced_and_no_trace_header_is_forwarded() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    async for c in serving(workers, None):
        response = await c.post("/v1/completions", json=BODY, headers={"traceparent": PARENT, "baggage": "k=v"})
        assert response.status_code == 200
        metrics = await c.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert metrics.headers["content-type"].startswith("text/plain")  # no exemplars to show: plain text
    for seen in workers.seen:
        assert "traceparent" not in seen.headers and "baggage" not in seen.headers


async def test_an_oversized_trace_header_is_refused_like_any_header() -> None:
    tracing, exported = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    async for c in serving(workers, tracing, limits={"max_header_bytes": 2048}):
        response = await c.post("/v1/completions", json=BODY, headers={"tracestate": "a=" + "b" * 4096})
        assert response.status_code == 431
    assert not workers.seen and exported.get_finished_spans() == ()


async def test_a_refused_request_ends_its_span_with_429() -> None:
    tracing, exported = in_memory()
    started = asyncio.Event()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(on_request=started.set, kv=asyncio.Event())})
    async for c in serving(workers, tracing, max_in_flight=1, admission_queue=0):
        first = asyncio.create_task(c.post("/v1/completions", json=BODY))
        await started.wait()  # the first request holds the only slot
        refused = await c.post("/v1/completions", json=BODY)
        assert refused.status_code == 429
        first.cancel()
    ended = [s for s in exported.get_finished_spans() if dict(s.attributes or {}).get(semconv.OUTCOME) == "overloaded"]
    assert len(ended) == 1 and dict(ended[0].attributes or {})[semconv.HTTP_RESPONSE_STATUS_CODE] == 429


async def test_ttft_and_handoff_carry_the_trace_id_as_exemplars_in_openmetrics() -> None:
    tracing, _ = in_memory()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    async for c in serving(workers, tracing):
        await c.post("/v1/completions", json=BODY, headers={"traceparent": PARENT})
        openmetrics = await c.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        plain = await c.get("/metrics")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    lines = openmetrics.text.splitlines()
    for metric in ("kvpush_ttft_seconds_bucket", "kvpush_decode_ttft_seconds_bucket", "kvpush_handoff_seconds_bucket"):
        assert any(line.startswith(metric) and f'trace_id="{TRACE}"' in line for line in lines), metric
    assert "trace_id" not in plain.text and plain.headers["content-type"].startswith("text/plain")
