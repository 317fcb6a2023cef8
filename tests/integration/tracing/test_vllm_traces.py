"""One trace per request across the router and both real vLLM CPU engines.

The session's shared push family (`UPSTREAM_PUSH`, upstream's NixlPushConnector: prefills on core 0, a decode on
core 1) exports to its own OTLP receiver (`--otlp-traces-endpoint`), and a router over p0 and the decode traces to
the same receiver. Spans of other modules' requests are there too: every check picks its trace by id. Each
request's spans are decoded from the OTLP protobuf the processes really sent: the router's server span (a child
of the client's traceparent, or a root), its prefill and decode leg spans under it, and each engine's own
`llm_request` span under the leg that called it (the router injected the leg's traceparent), all one trace id.
The exporters' batch delay is cut to 0.2 s (OTEL_BSP_SCHEDULE_DELAY) so the spans arrive within a second or two.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from stack.engines import Fleet
from stack.procs import free_port
from stack.routers import Router, router_spec
from tests.integration.families import UPSTREAM_PUSH, FamilyPool
from tests.integration.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.integration.support import LOGS, VLLM
from tests.integration.vllm_support import complete, request_body

pytestmark = [*VLLM, pytest.mark.family(UPSTREAM_PUSH)]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # ms between the batch processor's exports (default 5000)
CLIENT_TRACE = uuid.uuid4().hex
CLIENT_SPAN = uuid.uuid4().hex[:16]


@dataclass
class Traced:
    receiver: OtlpReceiver
    router_url: str


@pytest.fixture(scope="module")
def traced(family_pool: FamilyPool) -> Iterator[Traced]:
    family = family_pool.get(UPSTREAM_PUSH)
    engines, receiver = family.engines, family.receiver
    assert receiver is not None, "the family exports no spans"
    assert dict(family.spec.env)["OTEL_BSP_SCHEDULE_DELAY"] == FAST_EXPORT["OTEL_BSP_SCHEDULE_DELAY"]
    with Fleet(LOGS) as routers:
        flags = ("--health-interval", "0.5", "--tracing", "--otlp-traces-endpoint", receiver.grpc_endpoint)
        port = free_port()
        spec = router_spec(
            port,
            "push",
            [engines.prefills[0].engine_spec.prefill_arg()],
            [engines.decode.url],
            *flags,
            name=f"router-traced-{port}",
            env=FAST_EXPORT,
        )
        router = routers.start(Router(spec, log_dir=LOGS))
        router.wait_healthy(60.0)
        yield Traced(receiver, router.url)


def one_trace(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    """The trace's spans once the router's three and both engines' llm_request spans are in."""

    def complete_trace(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return len([s for s in mine if s.name == "llm_request"]) >= 2 and len(mine) >= 5

    spans = receiver.wait_for(complete_trace, f"trace {trace_id}: 3 router spans and 2 llm_request spans")
    return [s for s in spans if s.trace_id == trace_id]


def check_tree(spans: list[ReceivedSpan], pairing_id: str, client_span: str | None) -> None:
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (server,) = [s for s in spans if s.kind == "server" and s.service == "kvpush-router"]
    assert server.parent_span_id == client_span
    assert server.attributes["kvpush.outcome"] == "ok" and server.attributes["kvpush.route"] == "push"
    assert server.attributes["kvpush.pairing_id"] == pairing_id
    (prefill,) = by_name["kvpush.prefill"]
    (decode,) = by_name["kvpush.decode"]
    for leg in (prefill, decode):
        assert leg.parent_span_id == server.span_id and leg.kind == "client"
        assert leg.attributes["kvpush.attempt"] == 1 and leg.attributes["gen_ai.request.id"] == pairing_id
    assert "kvpush.first_byte" in decode.events
    engines = by_name["llm_request"]
    assert len(engines) == 2, [s.resource for s in engines]
    assert {s.parent_span_id for s in engines} == {prefill.span_id, decode.span_id}  # one under each leg
    for span in engines:
        assert span.service != "kvpush-router"
        assert pairing_id in str(span.attributes.get("gen_ai.request.id")), span.attributes


def test_a_client_trace_continues_through_the_router_and_both_engines(traced: Traced) -> None:
    body = request_body("chat", stream=True)
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "client=1"}
    with httpx.Client(timeout=120) as client:
        response = client.post(f"{traced.router_url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200 and "data: [DONE]" in response.text
    pairing_id = response.headers["x-kvpush-pairing-id"]
    check_tree(one_trace(traced.receiver, CLIENT_TRACE), pairing_id, CLIENT_SPAN)


def test_a_request_without_a_trace_is_a_new_root_joined_by_both_engines(traced: Traced) -> None:
    result = complete(traced.router_url, "completions", request_body("completions", stream=False))
    assert result.status == 200
    pairing_id = result.headers["x-kvpush-pairing-id"]
    roots = traced.receiver.wait_for(
        lambda spans: any(s.attributes.get("kvpush.pairing_id") == pairing_id for s in spans), "the router's span"
    )
    (server,) = [s for s in roots if s.attributes.get("kvpush.pairing_id") == pairing_id]
    assert server.parent_span_id is None and server.trace_id != CLIENT_TRACE
    check_tree(one_trace(traced.receiver, server.trace_id), pairing_id, None)


def test_a_bad_traceparent_is_ignored_and_the_request_served(traced: Traced) -> None:
    body = request_body("completions", stream=False)
    with httpx.Client(timeout=120) as client:
        response = client.post(
            f"{traced.router_url}/v1/completions", json=body, headers={"traceparent": f"00-{'0' * 32}-{'1' * 16}-01"}
        )
    assert response.status_code == 200
    pairing_id = response.headers["x-kvpush-pairing-id"]
    spans = traced.receiver.wait_for(
        lambda got: any(s.attributes.get("kvpush.pairing_id") == pairing_id for s in got), "the router's span"
    )
    (server,) = [s for s in spans if s.attributes.get("kvpush.pairing_id") == pairing_id]
    assert server.parent_span_id is None and server.trace_id != "0" * 32
