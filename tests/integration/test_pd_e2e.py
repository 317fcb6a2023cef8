"""The router on real vLLM CPU engines, end to end, over each KV connector: upstream's NixlPushConnector (push),
ours (KvpushConnector, push) and upstream's NixlConnector (pull).

Each connector's family comes from the session's pool (tests/integration/families.py), one family at a time: p0,
a plain prefill, and p1 on core 0; d, the decode, on core 1. Upstream's push family is the shared `UPSTREAM_PUSH`
(multiturn, tracing, KV-event replicas and the deploy scrape run on it first: prompts are unique and counters read
as deltas). Our family's p1 is chunked (2 tokens a step: an 1850-token prompt stays in prefill for about 900
steps, seconds even on a fast machine, so a test can act while it runs) and has a second router with deadlines
far above any bound here. The main router uses p0. Every test runs on every connector unless it checks our
connector's own metrics or wire (those skip, saying so, on upstream's). The last test kills p1 for good, so it
must stay last in this file; it spoils the family (marked so: it runs last of its family's group too).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from stack.engines import prefill_arg
from tests.integration.connector.kvpush_support import (
    CONNECTOR,
    CONNECTOR_EXTRA,
    KV_TIMEOUT_S,
    MODULE,
    FailingPrefill,
    decode_params,
    post,
    prefill_body,
    push,
    read_stream,
)
from tests.integration.families import UPSTREAM_PUSH, Family, FamilyPool, FamilySpec, pairs
from tests.integration.support import VLLM, metric, wait_for
from tests.integration.vllm_support import (
    SETTLE,
    Engines,
    complete,
    is_idle,
    kv_sources,
    path_of,
    prompt_text,
    request_body,
    router,
    timing,
    wait_idle,
)

pytestmark = VLLM
# Our p1: chunked prefill, 2 prompt tokens a step for each of up to two requests at once (a budget of 4 split by the
# long-prefill threshold, so two prompts advance together), in a KV cache of 16 usable blocks of 128 tokens (and
# vLLM's null block: the least vLLM accepts for the launcher's 2048-token length). Two prompts of ten blocks each
# outgrow it together, so vLLM preempts one mid-prefill (issue 38, issue 42 item 4).
CHUNKED = ("--max-num-batched-tokens", "4", "--long-prefill-token-threshold", "2", "--max-num-seqs", "2")
SMALL_CACHE = ("--num-gpu-blocks-override", "17")
PREEMPTED_WORDS = 95  # about 1170 prompt tokens: ten blocks
LONG_WORDS = 150  # about 1850 prompt tokens: some 900 prefill steps on our chunked p1
KILL_BOUND = 20.0  # decode must end a request whose prefill died well within this (vLLM's own watchdog: 480 s)


@dataclass(frozen=True)
class Connector:
    """One KV connector on every engine of a family, and the router mode that drives it."""

    id: str
    name: str
    mode: str
    module: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    p1_args: tuple[str, ...] = ()

    @property
    def ours(self) -> bool:
        return self.name == CONNECTOR

    @property
    def family(self) -> FamilySpec:
        """Its family: two prefills (p1 with `p1_args`) and a decode; upstream's push one is the shared superset."""
        if self.id == "upstream-push":
            return UPSTREAM_PUSH
        extra = pairs(self.extra)
        return FamilySpec(self.id, self.name, self.module, 2, ((), self.p1_args), connector_extra=extra)


CONNECTORS = (
    Connector("upstream-push", "NixlPushConnector", "push"),
    Connector("kvpush-push", CONNECTOR, "push", MODULE, CONNECTOR_EXTRA, CHUNKED + SMALL_CACHE),
    Connector("upstream-pull", "NixlConnector", "pull"),
)
# The kill at the end of each connector's tests spoils its family: it runs last of the family's group.
PARAMS = [pytest.param(c, id=c.id, marks=pytest.mark.family(c.family, spoils=True)) for c in CONNECTORS]


@dataclass
class Stack:
    connector: Connector
    family: Family
    engines: Engines
    router_url: str  # over p0
    slow_router_url: str | None  # ours only: over the chunked p1, long deadlines

    @property
    def mode(self) -> str:
        return self.connector.mode

    @property
    def decode_url(self) -> str:
        return self.engines.decode.url

    @property
    def p0_url(self) -> str:
        return self.engines.prefills[0].url

    def prefill_arg(self, index: int) -> str:
        return self.engines.prefills[index].engine_spec.prefill_arg()


@pytest.fixture(scope="module", params=PARAMS)
def stack(request: pytest.FixtureRequest, family_pool: FamilyPool) -> Iterator[Stack]:
    c: Connector = request.param
    family = family_pool.get(c.family)
    engines = family.engines
    with contextlib.ExitStack() as running:
        (p0, p1), d = (e.engine_spec.prefill_arg() for e in engines.prefills), engines.decode.url
        url = running.enter_context(router(c.mode, [p0], [d]))
        slow_url = None
        if c.ours:
            slow = ("--timeout", "decode_first_byte=400", "--timeout", "prefill=400")
            slow_url = running.enter_context(router(c.mode, [p1], [d], *slow))
        yield Stack(c, family, engines, url, slow_url)


@pytest.fixture
def ours(stack: Stack) -> Stack:
    """The stack, for a test of our connector's own metrics or wire: skips on upstream's connectors."""
    if not stack.connector.ours:
        pytest.skip(f"checks {CONNECTOR}'s own metrics or wire; this family runs {stack.connector.name}")
    return stack


def leave_when(
    base_url: str, body: dict[str, Any], state: Callable[[], bool], what: str, request_id: str | None = None
) -> None:
    """POST a completion on a raw connection and close it, unanswered, once `state()` holds (a client that leaves
    when something has happened, not after some seconds)."""
    host, port = base_url.removeprefix("http://").split(":")
    raw = httpx.Request("POST", f"{base_url}{path_of('completions')}", json=body)
    head = f"POST {raw.url.raw_path.decode()} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    head += f"X-Request-Id: {request_id}\r\n" if request_id else ""
    head += f"content-type: application/json\r\ncontent-length: {len(raw.content)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(head.encode() + raw.content)
        wait_for(state, what, interval=0.02)


def long_body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt_text(LONG_WORDS),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def transferred_since(stack: Stack, before: dict[str, float]) -> float:
    return kv_sources(stack.decode_url)["external_kv_transfer"] - before["external_kv_transfer"]


def assert_legs_order(stack: Stack, record: dict[str, Any]) -> None:
    """Push: decode's leg is sent while prefill still runs. Pull: only after prefill answered."""
    if stack.mode == "push":
        assert record["decode_sent"] < record["prefill_done"], "push legs must overlap"
    else:
        assert record["prefill_done"] <= record["decode_sent"], "pull legs run one after the other"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_output_equals_a_single_instance_and_the_prompt_came_from_prefill(
    stack: Stack, endpoint: str, stream: bool
) -> None:
    body = request_body(endpoint, stream)
    before = kv_sources(stack.decode_url)
    got = complete(stack.router_url, endpoint, body)
    assert got.status == 200, got.text
    assert got.prompt_tokens > 100
    wait_for(lambda: transferred_since(stack, before) >= got.prompt_tokens, "decode counted the prompt")
    after = kv_sources(stack.decode_url)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == got.prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    reference = complete(stack.p0_url, endpoint, body)  # the same request on one plain instance
    assert got.text == reference.text and got.text
    record = timing(stack.router_url, got.headers["x-kvpush-pairing-id"])
    assert record["outcome"] == "ok" and record["attempts"] == 1
    assert_legs_order(stack, record)


def test_a_partial_prefix_hit_on_decode_registers_only_the_blocks_it_lacks(ours: Stack) -> None:
    """G12 (issue 11 item 4): decode already holds the first turn's prompt in its prefix cache; for the second
    turn it registers only the blocks it lacks and prefill writes only those, so decode counts
    local_cache_hit + external_kv_transfer == prompt, and the answer still equals one instance's."""
    stack = ours
    first = request_body("completions", stream=False)
    got = complete(stack.router_url, "completions", first)
    assert got.status == 200, got.text
    second = dict(first, prompt=first["prompt"] + "\n" + " ".join(f"g{i} = f{i}(2)" for i in range(40)))
    before = kv_sources(stack.decode_url)
    again = complete(stack.router_url, "completions", second)
    assert again.status == 200, again.text
    wait_for(
        lambda: sum(kv_sources(stack.decode_url).values()) - sum(before.values()) >= again.prompt_tokens,
        "decode counted the second prompt",
    )
    after = kv_sources(stack.decode_url)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["local_cache_hit"] > 0, f"no local prefix hit on decode: {delta}"
    assert delta["external_kv_transfer"] > 0, f"nothing transferred: {delta}"
    assert delta["local_cache_hit"] + delta["external_kv_transfer"] == again.prompt_tokens, delta
    assert delta["local_compute"] == 0, delta
    assert again.text == complete(stack.p0_url, "completions", second).text


def test_sixteen_concurrent_requests_succeed_and_each_prompt_is_transferred(stack: Stack) -> None:
    endpoints = ["completions" if i % 2 else "chat" for i in range(16)]
    bodies = [request_body(e, stream=i % 3 != 0) for i, e in enumerate(endpoints)]
    before = kv_sources(stack.decode_url)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda eb: complete(stack.router_url, *eb), zip(endpoints, bodies, strict=True)))
    assert [r.status for r in results] == [200] * 16, [r.text for r in results if r.status != 200]
    assert all(r.text for r in results)
    expected = sum(r.prompt_tokens for r in results)  # JSON answers and streams (include_usage) carry usage
    assert all(r.prompt_tokens > 100 for r in results)
    wait_for(lambda: transferred_since(stack, before) >= expected, "decode counted every prompt")
    assert transferred_since(stack, before) == expected
    assert kv_sources(stack.decode_url)["local_compute"] == before["local_compute"]
    for r in results:
        record = timing(stack.router_url, r.headers["x-kvpush-pairing-id"])
        assert record["outcome"] == "ok"
        assert_legs_order(stack, record)
    wait_idle(stack.engines, [stack.p0_url, stack.decode_url], "after sixteen requests")


def test_a_router_learns_the_prefill_identity_from_its_first_answer(stack: Stack) -> None:
    """A bare --prefill URL: the first request's prefill runs alone and states the NIXL identity; then push."""
    if stack.mode != "push":
        pytest.skip("pull mode needs no prefill identity before the prefill answers")
    with router("push", [stack.p0_url], [stack.decode_url]) as url:
        bodies = [request_body("completions", stream=False) for _ in range(2)]
        results = [complete(url, "completions", b) for b in bodies]
        first, second = (timing(url, r.headers["x-kvpush-pairing-id"]) for r in results)
    assert [r.status for r in results] == [200, 200], [r.text for r in results]
    for body, got in zip(bodies, results, strict=True):
        assert got.text == complete(stack.p0_url, "completions", body).text
    assert first["prefill_done"] <= first["decode_sent"], "identity learned from a first, sequential prefill"
    assert second["decode_sent"] < second["prefill_done"], "then both legs at once"


def test_a_client_leaving_during_prefill_leaves_nothing_running_or_held(ours: Stack) -> None:
    """The client goes while p1 is still prefilling (decode waits for KV): both legs end, no block stays held."""
    stack = ours
    assert stack.slow_router_url is not None
    p1 = stack.engines.prefills[1]

    def ended_transfers() -> float:  # cancelled on either side, or failed on decode
        return (
            metric(p1.url, "vllm:kvpush_cancelled_total")
            + metric(stack.decode_url, "vllm:kvpush_cancelled_total")
            + metric(stack.decode_url, "vllm:kvpush_failed_transfers_total")
        )

    before = ended_transfers()
    leave_when(
        stack.slow_router_url,
        long_body(8, True),
        lambda: (
            metric(p1.url, "vllm:num_requests_running") >= 1
            and metric(stack.decode_url, "vllm:num_requests_waiting") >= 1
        ),
        "p1 prefills while decode waits for the KV",
    )
    wait_idle(stack.engines, [p1.url, stack.decode_url], "after the client left during prefill")
    record = httpx.get(f"{stack.slow_router_url}/debug/timings", timeout=10).json()["requests"][-1]
    assert record["outcome"] == "client_gone"
    assert record["prefill_done"] is None and record["decode_first_byte"] is None, "the client left during prefill"
    # Decode's registration was cancelled (D) or refused as failed prefill (P): the connector saw it end.
    wait_for(lambda: ended_transfers() > before, "the connector recorded the abandoned transfer")


def test_a_client_leaving_during_decode_stops_the_request_and_leaves_nothing_held(stack: Stack) -> None:
    body = request_body("completions", stream=True, max_tokens=1500)
    url = f"{stack.router_url}{path_of('completions')}"
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert got
        wait_for(lambda: metric(stack.decode_url, "vllm:num_requests_running") >= 1, "decode is generating")
    # decode aborted the request: nothing running or waiting, no block held, on decode or on p0
    wait_idle(stack.engines, [stack.p0_url, stack.decode_url], "after the client left during decode")
    record = httpx.get(f"{stack.router_url}/debug/timings", timeout=10).json()["requests"][-1]
    assert record["outcome"] == "client_gone"


def test_a_retry_with_fresh_ids_never_pairs_with_the_failed_attempt(ours: Stack) -> None:
    """Attempt 1: decode registers its blocks with p0's connector (the stand-in prefill carries p0's
    identity), then the stand-in's prefill leg fails, the router cancels decode and retries with fresh
    X-Request-Id / transfer_id on the real p0. The retry must pair only with its own transfer."""
    stack = ours
    p0 = stack.engines.prefills[0]
    spec = p0.engine_spec
    assert spec.engine_id is not None and spec.side_port is not None
    cancelled = metric(p0.url, "vllm:kvpush_cancelled_total")
    with (
        FailingPrefill(delay=1.5) as fake,
        router(
            "push",
            [prefill_arg(fake.url, spec.engine_id, spec.side_port), spec.prefill_arg()],
            [stack.decode_url],
            "--prefill-policy",
            "round-robin",
            "--retries",
            "1",
        ) as url,
    ):
        before = kv_sources(stack.decode_url)
        bodies = [request_body("completions", stream=False) for _ in range(2)]
        results = [complete(url, "completions", b) for b in bodies]
        records = [timing(url, r.headers["x-kvpush-pairing-id"]) for r in results]
    assert [r.status for r in results] == [200, 200], [r.text for r in results]
    assert fake.calls >= 1 and any(rec["attempts"] == 2 for rec in records)
    for body, got in zip(bodies, results, strict=True):
        assert got.text == complete(stack.p0_url, "completions", body).text
    prompt = sum(r.prompt_tokens for r in results)
    wait_for(lambda: transferred_since(stack, before) >= prompt, "decode counted both prompts")
    assert transferred_since(stack, before) == prompt  # the failed attempt loaded nothing
    assert kv_sources(stack.decode_url)["local_compute"] == before["local_compute"]
    # The failed attempt's registration reached p0 and was cancelled there, not written.
    wait_for(lambda: metric(p0.url, "vllm:kvpush_cancelled_total") > cancelled, "p0 acked the stale cancel")
    wait_idle(stack.engines, [p0.url, stack.decode_url], "after the retried requests")


def test_the_official_openai_client_works(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    prompt = prompt_text()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    extra = {"ignore_eos": True}
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body=extra
        )
        if c.choices
    ]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
    assert len(pieces) == 8 and "".join(pieces) == whole.choices[0].text
    chat = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True, extra_body=extra
        )
        if c.choices
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )
    assert "".join(chat) and reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="", max_tokens=4)


# ---- both legs straight to the engines (p0, d), as the router sends them: our connector's wire -------------


def plain_body(words: int = 60, max_tokens: int = 12) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt_text(words),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_push_output_equals_single_instance_and_kv_came_from_prefill(ours: Stack) -> None:
    stack, b = ours, plain_body()
    before = kv_sources(stack.decode_url)
    p_res, d_res = push(stack.engines, b)
    assert p_res.status_code == 200, p_res.text
    assert d_res.status_code == 200, d_res.text
    assert p_res.json()["kv_transfer_params"]["transfer_mode"] == "push"
    prompt_tokens = d_res.json()["usage"]["prompt_tokens"]
    wait_for(lambda: transferred_since(stack, before) >= prompt_tokens, "decode counted the prompt")
    assert transferred_since(stack, before) == prompt_tokens
    assert kv_sources(stack.decode_url)["local_compute"] == before["local_compute"]
    reference = post(stack.p0_url, b, f"kvp-{uuid.uuid4().hex}").json()
    assert d_res.json()["choices"][0]["text"] == reference["choices"][0]["text"]


def test_sixteen_concurrent_pushes(ours: Stack) -> None:
    stack = ours
    before = kv_sources(stack.decode_url)
    xfers = metric(stack.p0_url, "vllm:kvpush_xfer_time_seconds_count")
    runs = {s: _run_blocks(stack.p0_url, s) for s in ("prefill", "decode", "both")}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: push(stack.engines, plain_body(40, 8)), range(16)))
    assert all(r.status_code == 200 for legs in results for r in legs), [r.text for legs in results for r in legs]
    sent = sum(d.json()["usage"]["prompt_tokens"] for _, d in results)
    wait_for(lambda: transferred_since(stack, before) >= sent, "decode counted every prompt")
    assert transferred_since(stack, before) == sent
    wait_for(lambda: metric(stack.p0_url, "vllm:kvpush_xfer_time_seconds_count") - xfers >= 16, "p0 wrote 16 times")
    # issue 44: every WRITE's block ids reach P's run histograms; the same blocks on each side, and runs on both
    # sides at once are at least as many as on either side alone (a pair breaks a run when either side does)
    now = {s: _run_blocks(stack.p0_url, s) for s in ("prefill", "decode", "both")}
    (blocks_p, runs_p), (blocks_d, runs_d), (blocks_b, runs_b) = (
        (now[s][0] - runs[s][0], now[s][1] - runs[s][1]) for s in ("prefill", "decode", "both")
    )
    assert blocks_p == blocks_d == blocks_b >= 16, now
    assert runs_b >= max(runs_p, runs_d) >= 16, now


def _run_blocks(url: str, side: str) -> tuple[float, float]:
    """(blocks, runs) written so far per P's vllm:kvpush_run_blocks_<side> histogram."""
    name = f"vllm:kvpush_run_blocks_{side}"
    return metric(url, f"{name}_sum"), metric(url, f"{name}_count")


def test_a_chunked_prefill_is_pushed_step_by_step_and_decode_answers_as_one_instance(ours: Stack) -> None:
    """G14, progressive push (on by default): through the router over our chunked p1 (2 prompt tokens a step),
    p1 posts more than one WRITE for one request, at least one of them without Done; decode counts the whole
    prompt as transferred and answers as one instance does."""
    stack, p1 = ours, ours.engines.prefills[1].url
    assert stack.slow_router_url is not None
    writes, partial = metric(p1, "vllm:kvpush_writes_posted_total"), metric(p1, "vllm:kvpush_partial_writes_total")
    before = kv_sources(stack.decode_url)
    body = plain_body(50)  # about 600 prompt tokens: some 300 prefill steps, several full KV blocks
    got = complete(stack.slow_router_url, "completions", body)
    assert got.status == 200, got.text
    wait_for(lambda: transferred_since(stack, before) >= got.prompt_tokens, "decode counted the prompt")
    assert transferred_since(stack, before) == got.prompt_tokens
    assert kv_sources(stack.decode_url)["local_compute"] == before["local_compute"]
    posted = metric(p1, "vllm:kvpush_writes_posted_total") - writes
    assert posted >= 2, f"p1 posted {posted} WRITE(s) for a prompt of {got.prompt_tokens} tokens"
    assert metric(p1, "vllm:kvpush_partial_writes_total") - partial >= 1, "every WRITE carried Done"
    assert got.text == complete(stack.p0_url, "completions", body).text


def test_a_prefill_preempted_under_progressive_push_answers_as_one_instance_and_holds_nothing(ours: Stack) -> None:
    """Two prompts of ten blocks at once on p1 (16 blocks, 2 tokens a step) outgrow its KV cache: vLLM preempts one
    after partial WRITEs, frees its blocks and recomputes it. The connector fences the WRITE in flight before the
    forward reuses the blocks, pushes no more partial WRITEs and writes every recomputed block in the final one:
    each answer equals a single instance's (or fails with a clear error, never a mix), and nothing stays held."""
    stack, p1 = ours, ours.engines.prefills[1].url
    assert stack.slow_router_url is not None
    slow = stack.slow_router_url
    preemptions = metric(p1, "vllm:num_preemptions_total")
    partial = metric(p1, "vllm:kvpush_partial_writes_total")
    bodies = [plain_body(PREEMPTED_WORDS, 8) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda b: complete(slow, "completions", b, timeout=400.0), bodies))
    assert metric(p1, "vllm:num_preemptions_total") > preemptions, "the small KV cache preempted nothing"
    assert metric(p1, "vllm:kvpush_partial_writes_total") > partial, "no partial WRITE before the preemption"
    for body, got in zip(bodies, results, strict=True):
        if got.status != 200:
            assert got.status >= 500 and "error" in json.loads(got.text), got.text  # failed cleanly
            continue
        assert got.text == complete(stack.p0_url, "completions", body).text, "decode mixed old and recomputed KV"
    assert any(got.status == 200 for got in results), [got.text for got in results]
    wait_idle(stack.engines, [p1, stack.decode_url], "after a preempted prefill leg")


def test_decode_disconnect_before_prefill_is_cancelled_and_leaks_nothing(ours: Stack) -> None:
    """Decode registers, its client leaves before any prefill: D cancels, P acks, D frees its blocks;
    the late prefill leg of that transfer is refused a pairing and P frees its blocks at once."""
    stack = ours
    engines = stack.engines
    rid, tid = f"kvp-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    b = plain_body()
    cancelled = metric(stack.p0_url, "vllm:kvpush_cancelled_total")
    leave_when(
        stack.decode_url,
        dict(b, kv_transfer_params=decode_params(engines, 0, rid, tid)),
        lambda: metric(stack.decode_url, "vllm:num_requests_waiting") >= 1,
        "decode registered and waits for the KV",
        rid,
    )
    wait_idle(engines, [stack.decode_url], "decode after its client left")
    late = post(stack.p0_url, prefill_body(b, tid), rid)
    assert late.status_code == 200
    wait_idle(engines, [stack.p0_url], "p0 after the late prefill")
    wait_for(lambda: metric(stack.p0_url, "vllm:kvpush_cancelled_total") > cancelled, "p0 acked the cancel")


# ---- the kill (last for each connector) ---------------------------------------------------------------------


def test_a_killed_prefill_fails_fast_or_retries_and_the_router_routes_around_it(stack: Stack) -> None:
    """Runs last for each connector: kills p1 for good under a router over p0 and p1 (round robin)."""
    stack.family.spoil()  # whatever happens next, no later test gets this family
    if stack.connector.ours:
        _kill_mid_push_and_under_the_router(stack)
    else:
        _kill_under_the_router(stack)


def _kill_under_the_router(stack: Stack) -> None:
    """Upstream's connectors: each request in flight when p1 dies succeeds or fails saying the prefill failed;
    then the router keeps to p0, stays ready and decode has nothing stuck."""
    victim = stack.engines.prefills[1]
    specs = [stack.prefill_arg(0), stack.prefill_arg(1)]
    with router(stack.mode, specs, [stack.decode_url], "--prefill-policy", "round-robin") as url:
        warm = [complete(url, "completions", request_body("completions", True)) for _ in range(2)]
        assert [r.status for r in warm] == [200, 200]
        with ThreadPoolExecutor(6) as pool:
            running = [
                pool.submit(_status_and_error, url, request_body("completions", True, 64), 60.0) for _ in range(6)
            ]
            assert victim.pid is not None
            os.killpg(victim.pid, signal.SIGKILL)
            results = [f.result() for f in running]
        after = [complete(url, "chat", request_body("chat", i % 2 == 0), 60.0) for i in range(4)]
        for status, message in results:
            assert status in (200, 502, 503, 504), message
            if status != 200:  # the failure is the prefill's, and the client is told so (not which URL)
                assert "prefill" in message and "http://" not in message, message
        assert [r.status for r in after] == [200] * 4, "the router must route around the dead prefill"
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 200
        states = {w["url"]: w["healthy"] for w in ready.json()["workers"]}
        assert states[str(victim.url)] is False
    wait_for(lambda: metric(stack.decode_url, "vllm:num_requests_running") == 0, "decode has nothing stuck")


def _kill_mid_push_and_under_the_router(stack: Stack) -> None:
    """Ours: kills p1 while (a) a push whose legs went straight to the engines is mid-prefill on p1 (no router
    deadline can end decode's wait: decode must end it with an error soon after p1 dies), and (b) requests
    through a router over p0 and p1 are in flight (those on p1 are retried with fresh ids on p0; the router then
    keeps to p0)."""
    victim, decode = stack.engines.prefills[1], stack.engines.decode
    specs = [stack.prefill_arg(0), stack.prefill_arg(1)]
    rid, tid = f"kvp-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    body = long_body(8, stream=True)
    killed_at: list[float] = []
    with (
        router("push", specs, [decode.url], "--prefill-policy", "round-robin") as url,
        ThreadPoolExecutor(8) as pool,
        httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client,
    ):
        warm = [complete(url, "completions", request_body("completions", False)) for _ in range(2)]
        assert [r.status for r in warm] == [200, 200], "both prefills serve before the kill"
        d_leg = pool.submit(
            read_stream,
            client,
            f"{decode.url}{path_of('completions')}",
            dict(body, kv_transfer_params=decode_params(stack.engines, 1, rid, tid)),
            rid,
            lambda: killed_at[0],
        )
        p_leg = pool.submit(
            client.post,
            f"{victim.url}{path_of('completions')}",
            json=prefill_body(dict(body, stream=False), tid),
            headers={"X-Request-Id": rid},
        )
        wait_for(
            lambda: (
                metric(victim.url, "vllm:num_requests_running") >= 1
                and metric(decode.url, "vllm:num_requests_waiting") >= 1
            ),
            "p1 prefills while decode waits for the KV",
            interval=0.02,
        )
        routed_bodies = [request_body("completions", True, 64) for _ in range(6)]
        routed = [pool.submit(complete, url, "completions", b, 60.0) for b in routed_bodies]
        wait_for(
            lambda: (
                metric(victim.url, "vllm:num_requests_running") + metric(victim.url, "vllm:num_requests_waiting") >= 2
            ),
            "routed requests reached p1",
            interval=0.02,
        )
        killed_at.append(time.monotonic())
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)
        end = d_leg.result(timeout=KILL_BOUND + 100)
        held = metric(decode.url, "vllm:kv_cache_usage_perc")  # read at once: the hold deadline runs from now on
        with pytest.raises(httpx.TransportError):
            p_leg.result(timeout=30)
        results = [f.result(timeout=120) for f in routed]
        records = [timing(url, r.headers["x-kvpush-pairing-id"]) for r in results if r.status == 200]
        after = [complete(url, "chat", request_body("chat", i % 2 == 0), 60.0) for i in range(4)]
        workers = {w["url"]: w["healthy"] for w in httpx.get(f"{url}/ready", timeout=10).json()["workers"]}
    print(
        f"decode ended {end.seconds:.2f} s after the kill: status {end.status}, finish {end.finish_reasons}, "
        f"events {end.events}, error {end.error}, body {end.other}; routed: {[r.status for r in results]}"
    )
    # (a) decode gave up on the direct push at once, with an error, and holds nothing for it
    assert end.seconds < KILL_BOUND, f"decode took {end.seconds:.1f} s to give up"
    failed = (
        end.status >= 400
        or end.error is not None
        or "error" in end.finish_reasons
        or any("error" in e for e in end.events)
    )
    assert failed, f"decode answered as if the KV had arrived: {end}"
    assert end.finish_reasons != ["length"], f"decode generated a whole answer without KV: {end}"
    assert metric(decode.url, "vllm:kvpush_failed_transfers_total") >= 1
    # (c) G2: a lost link does not prove p1's process gone, so decode keeps those blocks (quarantine) until
    # their hold deadline (kv_timeout_s after the registration), then frees them
    assert held > stack.engines.idle_usage[decode.url], "freed at once"
    # (b) the router: no request on p1 had sent anything to its client (decode waited for p1's KV), so each is
    # retried with fresh ids on p0; the retry pairs only with its own transfer (same text as one instance).
    assert [r.status for r in results] == [200] * 6, [r.text for r in results]
    retried = [i for i, rec in enumerate(records) if rec["attempts"] == 2]
    assert retried, "a request was on p1 when it died"
    for i in retried:
        assert results[i].text == complete(stack.p0_url, "completions", routed_bodies[i]).text
    assert [r.status for r in after] == [200] * 4, [r.text for r in after]
    assert workers[victim.url] is False
    wait_idle(stack.engines, [stack.p0_url], "p0 after the prefill died")
    wait_for(
        lambda: is_idle(stack.engines, decode.url),
        "decode freed the quarantined blocks at their hold deadline",
        timeout=KV_TIMEOUT_S + SETTLE,
    )
    assert complete(decode.url, "completions", request_body("completions", stream=False)).status == 200


def _status_and_error(url: str, body: dict[str, Any], timeout: float) -> tuple[int, str]:
    """A streamed completion read to its end: its status and, when it failed, the error message it carried."""
    with httpx.Client(timeout=timeout) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, str(json.loads(r.read())["error"]["message"])
        errors = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith('data: {"error"')]
        return 200, str(errors[0]["error"]["message"]) if errors else ""
