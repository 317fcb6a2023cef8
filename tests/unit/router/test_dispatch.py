"""The dispatcher's choreographies against scripted workers: ids, overlap, order, failures, retries, deadlines."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import httpx
import pytest

from router.answer import JsonAnswer, StreamAnswer
from router.config import build_settings
from router.decider import AnswerCheck, Decider, Decision, Outcome, Route, Turn
from router.dispatch import ClientRequest, Dispatcher
from router.domain import Endpoint, Role, WorkerView
from router.errors import NoHealthyWorker, UpstreamError, UpstreamProtocolError, UpstreamStatus, UpstreamTimeout
from router.legs.httpx import HttpxLegs
from router.metrics import Metrics
from router.protocol import parse_request
from router.timings import TimingLog
from router.workers.pool import Loss, Pool, Tracked, unless_lost
from tests.unit.router.fake_workers import FakeWorkers, decode_error_event, decode_ok, hang, prefill_ok, status

P0 = "http://p0:8100,engine_id=p0,side_host=127.0.0.9,side_port=5600"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}


async def make(
    workers: FakeWorkers, decider: Decider | None = None, **settings: Any
) -> tuple[Dispatcher, Pool, TimingLog]:
    s = build_settings({"prefill": [P0], "decode": ["http://d0:8200"]}, settings)
    metrics, timings = Metrics(), TimingLog(100)
    pool = Pool((*s.prefill, *s.decode), metrics)
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    return Dispatcher(s, pool, HttpxLegs(client), metrics, timings, decider=decider), pool, timings


def call_of(
    dispatcher: Dispatcher, body: dict[str, Any] = BODY, endpoint: Endpoint = Endpoint.COMPLETIONS
) -> ClientRequest:
    info = parse_request(endpoint, body)
    return ClientRequest(body=body, info=info, record=dispatcher.new_record("client-1", info))


async def relay(answer: StreamAnswer | JsonAnswer) -> list[bytes]:
    assert isinstance(answer, StreamAnswer)
    try:
        return [event async for event in answer.events()]
    finally:
        await answer.aclose()


async def test_push_sends_decode_before_prefill_finishes_with_one_pairing() -> None:
    gate = asyncio.Event()
    workers = FakeWorkers({"p0": prefill_ok(gate=gate), "d0": decode_ok(on_request=gate.set)})
    dispatcher, _, timings = await make(workers)
    call = call_of(dispatcher)
    events = await relay(await dispatcher.handle(call))  # prefill only answers once decode has been sent
    assert len(events) == 4 and events[-1] == b"data: [DONE]\n\n"
    (p_leg,), (d_leg,) = workers.legs("p0"), workers.legs("d0")
    assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"] == call.record.pairing_id
    assert p_leg.body["kv_transfer_params"]["transfer_id"] == d_leg.body["kv_transfer_params"]["transfer_id"]
    assert d_leg.body["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert p_leg.path == d_leg.path == "/v1/completions"
    assert p_leg.body["max_tokens"] == 1 and d_leg.body["max_tokens"] == 3
    (record,) = timings.query(request_id="client-1")
    assert record["decode_sent"] < record["prefill_done"]
    assert record["outcome"] == "ok" and record["handoff_ms"] is not None


async def test_pull_sends_decode_after_prefill_with_its_params() -> None:
    workers = FakeWorkers({"p0": prefill_ok(mode="pull"), "d0": decode_ok()})
    dispatcher, _, timings = await make(workers, mode="pull")
    await relay(await dispatcher.handle(call_of(dispatcher)))
    (d_leg,) = workers.legs("d0")
    assert d_leg.body["kv_transfer_params"]["remote_block_ids"] == [[1, 2]]
    (record,) = timings.query()
    assert record["prefill_done"] <= record["decode_sent"]


async def test_non_streamed_answer_is_decodes_body_verbatim() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(tokens=5)})
    dispatcher, _, _ = await make(workers)
    answer = await dispatcher.handle(call_of(dispatcher, {**BODY, "stream": False}))
    assert isinstance(answer, JsonAnswer) and b'"xxxxx"' in answer.content


async def test_prefill_failure_closes_decode_and_reports_when_no_other_prefill() -> None:
    closed = asyncio.Event()
    workers = FakeWorkers({"p0": status(500), "d0": hang(closed)})
    dispatcher, _, timings = await make(workers)
    with pytest.raises(UpstreamStatus) as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.leg == "prefill" and info.value.http_status == 502
    assert closed.is_set()
    assert timings.query()[0]["outcome"] == "status"


async def test_prefill_failure_is_retried_with_fresh_ids_on_another_prefill() -> None:
    kv = asyncio.Event()
    workers = FakeWorkers({"p0": status(503), "p1": prefill_ok("p1", done=kv), "d0": decode_ok(kv=kv)})
    dispatcher, _, timings = await make(
        workers, prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"], prefill_policy="round-robin"
    )
    await relay(await dispatcher.handle(call_of(dispatcher)))
    (failed,), (retried,) = workers.legs("p0"), workers.legs("p1")
    assert failed.headers["x-request-id"] != retried.headers["x-request-id"]
    assert failed.body["kv_transfer_params"]["transfer_id"] != retried.body["kv_transfer_params"]["transfer_id"]
    decode = workers.legs("d0")[-1]
    assert decode.headers["x-request-id"] == retried.headers["x-request-id"]
    assert decode.body["kv_transfer_params"]["remote_engine_id"] == "p1"
    assert timings.query()[0]["attempts"] == 2


async def test_a_refused_prefill_is_marked_down_and_skipped() -> None:
    workers = FakeWorkers({"p1": prefill_ok("p1"), "d0": decode_ok()})
    dispatcher, pool, _ = await make(
        workers, prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"], prefill_policy="round-robin"
    )
    workers.down.add("p0")
    await relay(await dispatcher.handle(call_of(dispatcher)))
    assert [v.id for v in pool.candidates(Role.PREFILL)] == ["http://p1:8100"]
    assert pool.ready()


async def test_decode_client_error_passes_through_without_retry() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": status(400, "prompt too long")})
    dispatcher, _, _ = await make(workers)
    with pytest.raises(UpstreamStatus) as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.http_status == 400
    assert info.value.to_body()["error"]["message"] == "prompt too long"
    assert len(workers.legs("d0")) == 1


async def test_decode_first_byte_deadline_cancels_both_legs() -> None:
    closed = asyncio.Event()
    workers = FakeWorkers({"p0": hang(closed), "d0": hang()})
    dispatcher, _, _ = await make(workers, timeouts={"decode_first_byte": 0.05})
    with pytest.raises(UpstreamTimeout) as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.leg == "decode" and info.value.http_status == 504
    assert closed.is_set()


async def test_auto_identity_is_learned_from_a_first_sequential_prefill() -> None:
    workers = FakeWorkers({"p0": prefill_ok("learned"), "d0": decode_ok()})
    dispatcher, pool, timings = await make(workers, prefill=["http://p0:8100"])
    await relay(await dispatcher.handle(call_of(dispatcher)))
    first = timings.query()[0]
    assert first["prefill_done"] <= first["decode_sent"]
    assert pool.get("http://p0:8100").identity is not None
    gate = asyncio.Event()
    workers.handlers = {"p0": prefill_ok("learned", gate=gate), "d0": decode_ok(on_request=gate.set)}
    await relay(await dispatcher.handle(call_of(dispatcher)))
    assert workers.legs("d0")[-1].body["kv_transfer_params"]["remote_engine_id"] == "learned"


async def test_a_pull_mode_prefill_behind_a_push_router_is_a_clear_error() -> None:
    workers = FakeWorkers({"p0": prefill_ok(mode="pull"), "d0": decode_ok()})
    dispatcher, _, _ = await make(workers, prefill=["http://p0:8100"])
    with pytest.raises(UpstreamProtocolError, match="pull-mode connector"):
        await dispatcher.handle(call_of(dispatcher))


async def test_closing_a_stream_midway_releases_it_and_records_the_client_leaving() -> None:
    hold = asyncio.Event()
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(tokens=5, hold=hold)})
    dispatcher, pool, timings = await make(workers)
    answer = await dispatcher.handle(call_of(dispatcher))
    assert isinstance(answer, StreamAnswer)
    events = answer.events()
    assert b"t0" in await anext(events)
    await events.aclose()
    await answer.aclose()
    assert timings.query()[0]["outcome"] == "client_gone"
    assert all(v.in_flight == 0 for role in Role for v in pool.candidates(role))


async def test_no_healthy_decode_is_503() -> None:
    workers = FakeWorkers({"p0": prefill_ok()}, down={"d0"})
    dispatcher, _, _ = await make(workers)
    with pytest.raises(NoHealthyWorker) as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.http_status == 503


async def test_an_error_event_before_any_token_is_a_failed_attempt_retried_elsewhere() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_error_event(), "d1": decode_ok()})
    dispatcher, _, timings = await make(
        workers, decode=["http://d0:8200", "http://d1:8200"], decode_policy="round-robin"
    )
    events = await relay(await dispatcher.handle(call_of(dispatcher)))
    assert b"t0" in events[0] and len(workers.legs("d0")) == len(workers.legs("d1")) == 1
    assert timings.query()[0]["attempts"] == 2


async def test_an_error_event_with_no_other_decode_is_a_clear_502() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_error_event("KV load failed")})
    dispatcher, _, _ = await make(workers)
    with pytest.raises(UpstreamError, match="KV load failed") as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.http_status == 502 and info.value.leg == "decode"


async def test_a_prefill_ejected_while_its_leg_hangs_is_retried_at_once_with_fresh_ids() -> None:
    kv = asyncio.Event()
    pool_ref: list[Pool] = []

    async def hung(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        # health marks p0 down while its leg is in flight (a SIGSTOPped engine: connected, silent)
        asyncio.get_running_loop().call_soon(lambda: pool_ref[0].report("http://p0:8100", ok=False, hard=True))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    workers = FakeWorkers({"p0": hung, "p1": prefill_ok("p1", done=kv), "d0": decode_ok(kv=kv)})
    dispatcher, pool, timings = await make(
        workers, prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"], prefill_policy="round-robin"
    )
    pool_ref.append(pool)
    async with asyncio.timeout(10):  # hang guard: without the race the leg waits for the 300 s prefill deadline
        events = await relay(await dispatcher.handle(call_of(dispatcher)))
    assert events[-1] == b"data: [DONE]\n\n"
    (lost,), (retried,) = workers.legs("p0"), workers.legs("p1")
    assert lost.headers["x-request-id"] != retried.headers["x-request-id"]
    assert timings.query()[0]["attempts"] == 2 and timings.query()[0]["outcome"] == "ok"
    assert all(v.in_flight == 0 for role in Role for v in pool.candidates(role))


async def test_a_decode_ejected_before_its_first_byte_is_retried_on_another_decode() -> None:
    pool_ref: list[Pool] = []

    async def hung(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        asyncio.get_running_loop().call_soon(lambda: pool_ref[0].report("http://d0:8200", ok=False, hard=True))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    workers = FakeWorkers({"p0": prefill_ok(), "d0": hung, "d1": decode_ok()})
    dispatcher, pool, timings = await make(
        workers, decode=["http://d0:8200", "http://d1:8200"], decode_policy="round-robin"
    )
    pool_ref.append(pool)
    async with asyncio.timeout(10):  # hang guard: decode_first_byte is 120 s
        await relay(await dispatcher.handle(call_of(dispatcher)))
    assert len(workers.legs("d0")) == len(workers.legs("d1")) == 1
    assert timings.query()[0]["attempts"] == 2


async def test_a_prefill_4xx_is_relayed_not_retried() -> None:
    never = asyncio.Event()  # decode waits for KV that a refused prefill never sends
    workers = FakeWorkers({"p0": status(400, "prompt too long"), "p1": status(400, "no"), "d0": decode_ok(kv=never)})
    dispatcher, _, _ = await make(workers, prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"])
    with pytest.raises(UpstreamStatus) as info:
        await dispatcher.handle(call_of(dispatcher))
    assert info.value.http_status == 400 and len(workers.legs("p0")) + len(workers.legs("p1")) == 1


async def test_client_facing_messages_name_the_role_and_logs_keep_the_worker() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": status(500, "engine died")})
    dispatcher, _, _ = await make(workers, retries=0)
    with pytest.raises(UpstreamStatus) as info:
        await dispatcher.handle(call_of(dispatcher))
    body = info.value.to_body()["error"]["message"]
    assert body.startswith("decode worker") and "d0:8200" not in body
    assert "http://d0:8200" in str(info.value)


class Recording:
    """A decider that bypasses prefill for every request and prefers d1; it keeps what it is told."""

    name: ClassVar[str] = "recording"
    wants_answer = True
    wants_token_ids = False
    wants_headers = True

    def __init__(self, route: Route = Route.BYPASS) -> None:
        self.route = route
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, decode: Sequence[WorkerView], prefill: Sequence[WorkerView], now: float) -> Decision:
        return Decision(self.route, decode="http://d1:8200")

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None:
        self.outcomes.append(outcome)
        return None

    def forget(self, worker_id: str) -> None:
        return None


USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}


def answers_with_usage() -> Any:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"text": "ab"}], "usage": USAGE})
        chunks = [
            b'data: {"choices": [{"text": "a"}]}\n\n',
            b'data: {"choices": [{"text": "b"}]}\n\n',
            b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks_of(chunks))

    return handle


async def chunks_of(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


@pytest.mark.parametrize("stream", [False, True])
async def test_a_bypass_decision_sends_the_plain_body_to_the_preferred_decode_and_learns_the_usage(
    stream: bool,
) -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(), "d1": answers_with_usage()})
    s = build_settings({"prefill": [P0], "decode": ["http://d0:8200", "http://d1:8200"]})
    metrics, timings, decider = Metrics(), TimingLog(10), Recording()
    pool = Pool((*s.prefill, *s.decode), metrics)
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    dispatcher = Dispatcher(s, pool, HttpxLegs(client), metrics, timings, decider=decider)
    answer = await dispatcher.handle(call_of(dispatcher, {**BODY, "stream": stream}))
    if stream:
        await relay(answer)
    assert workers.legs("p0") == [] and workers.legs("d0") == []
    (leg,) = workers.legs("d1")
    assert "kv_transfer_params" not in leg.body and leg.body["prompt"] == BODY["prompt"]
    (outcome,) = decider.outcomes
    assert (outcome.ok, outcome.decode, outcome.prefill) == (True, "http://d1:8200", None)
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens) == (7, 4, 2)
    assert outcome.answer == "ab"
    assert timings.query()[0]["mode"] == "bypass"
    assert metrics.decisions.labels("bypass")._value.get() == 1


async def test_without_a_decider_the_mode_routes_and_decisions_are_counted() -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok()})
    dispatcher, _, _ = await make(workers)
    await relay(await dispatcher.handle(call_of(dispatcher)))
    assert len(workers.legs("p0")) == 1 and "kv_transfer_params" in workers.legs("d0")[0].body
    assert dispatcher._metrics.decisions.labels("push")._value.get() == 1


async def test_a_whole_stream_in_one_chunk_is_relayed_as_it_came_and_its_usage_learned() -> None:
    stream = b'data: {"choices": [{"text": "ab"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 7}}\n\n'
    stream += b"data: [DONE]\n\n"

    async def at_once(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks_of([stream]))

    workers = FakeWorkers({"p0": prefill_ok(), "d1": at_once})
    decider = Recording()
    dispatcher, _, _ = await make(workers, decider, decode=["http://d1:8200"])
    assert await relay(await dispatcher.handle(call_of(dispatcher))) == [stream]
    (outcome,) = decider.outcomes
    assert outcome.prompt_tokens == 7 and outcome.answer == "ab"


@pytest.mark.parametrize(("options", "expected"), [({}, "d1"), ({"kv_weight": 0}, "d0")])
async def test_the_decode_policys_options_from_the_settings_steer_the_pick(
    options: dict[str, Any], expected: str
) -> None:
    from router.domain import EngineLoad

    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_ok(), "d1": decode_ok()})
    s = build_settings(
        {"prefill": [P0], "decode": ["http://d0:8200", "http://d1:8200"]},
        {"policy": {"decode": {"name": "load-aware", **options}}},
    )
    metrics, timings = Metrics(), TimingLog(100)
    pool = Pool((*s.prefill, *s.decode), metrics)
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    # d0: idle engine but half its KV in use (score 2 with the default kv_weight 4, 0 with kv_weight 0);
    # d1: one request running and no KV in use (score 1 either way)
    pool.set_load("http://d0:8200", EngineLoad(running=0, waiting=0, kv_usage=0.5))
    pool.set_load("http://d1:8200", EngineLoad(running=1, waiting=0, kv_usage=0.0))
    dispatcher = Dispatcher(s, pool, HttpxLegs(client), metrics, timings)
    await relay(await dispatcher.handle(call_of(dispatcher)))
    assert [name for name in ("d0", "d1") if workers.legs(name)] == [expected]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_with_reasoning_is_not_credited_as_text(stream: bool) -> None:
    # the engine cached the reasoning tokens too, which the client never sends back as text (vLLM #43094)
    async def reasons(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if not body.get("stream"):
            message = {"role": "assistant", "content": "ab", "reasoning_content": "think"}
            return httpx.Response(200, json={"choices": [{"message": message}], "usage": USAGE})
        chunks = [
            b'data: {"choices": [{"delta": {"reasoning_content": "think"}}]}\n\n',
            b'data: {"choices": [{"delta": {"content": "ab"}}]}\n\n',
            b"data: [DONE]\n\n",
        ]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks_of(chunks))

    workers = FakeWorkers({"p0": prefill_ok(), "d1": reasons})
    decider = Recording()
    dispatcher, _, _ = await make(workers, decider, decode=["http://d1:8200"])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    answer = await dispatcher.handle(call_of(dispatcher, body, Endpoint.CHAT))
    if stream:
        await relay(answer)
    (outcome,) = decider.outcomes
    assert outcome.ok and outcome.answer is None


async def test_the_only_decode_ejected_before_its_first_byte_is_a_503() -> None:
    pool_ref: list[Pool] = []

    async def hung(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        asyncio.get_running_loop().call_soon(lambda: pool_ref[0].report("http://d0:8200", ok=False, hard=True))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    workers = FakeWorkers({"p0": prefill_ok(), "d0": hung})
    dispatcher, pool, _ = await make(workers)
    pool_ref.append(pool)
    with pytest.raises(UpstreamError) as info:
        async with asyncio.timeout(10):  # hang guard: decode_first_byte is 120 s
            await dispatcher.handle(call_of(dispatcher))
    assert info.value.http_status == 503 and info.value.leg == "decode"
    assert info.value.to_body()["error"]["type"] == "service_unavailable"


async def test_a_worker_lost_as_its_leg_answers_never_cancels_what_the_request_does_next() -> None:
    """The race behind a plain-text 500 on real vLLM: a prefill killed under load is marked lost (by another leg's
    passive check) in the same loop turn as this leg's own answer or error arrives. The loss may fail this leg, but
    it must not leak a cancellation into the retry or the decode leg that follows."""
    tracked = Tracked("p0")
    answered: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def leg() -> str:
        try:
            async with unless_lost(tracked, Role.PREFILL):
                got = await answered
        except UpstreamError as lost:
            got = lost.kind
        for _ in range(3):  # what follows the leg: the retry loop, the decode leg
            await asyncio.sleep(0)
        return got

    task = asyncio.create_task(leg())
    await asyncio.sleep(0)  # the leg now waits for its answer
    tracked.mark_lost(Loss.DOWN, "passive health: connection reset")
    if not answered.done():
        answered.set_result("ok")
    assert await task in ("ok", "worker_lost")


async def test_a_loss_marked_by_the_leg_itself_inside_the_block_does_not_cancel_it() -> None:
    tracked = Tracked("p0")
    async with unless_lost(tracked, Role.PREFILL):
        tracked.mark_lost(Loss.DOWN, "its own passive check")
    await asyncio.sleep(0)
    assert tracked.is_lost and asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


class Checking(Recording):
    """Recording, and it wants the answer's token ids: hands back a check whose settlement it keeps."""

    wants_token_ids = True

    def __init__(self, route: Route = Route.BYPASS) -> None:
        super().__init__(route)
        self.settled: list[int] = []

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None:
        self.outcomes.append(outcome)
        if outcome.answer is None or outcome.answer_token_ids is None:
            return None
        settle = self.settled.append
        return AnswerCheck(outcome.decode, outcome.answer, outcome.answer_token_ids, lambda n, _m, _t: settle(n))


def answers_with_token_ids() -> Any:
    """A decode that sends vLLM's token-id fields (null unless asked)."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        asked = body.get("return_token_ids") is True
        ids: list[list[int] | None] = [[5], [6]] if asked else [None, None]
        if not body.get("stream"):
            whole = {"choices": [{"text": "ab", "token_ids": [5, 6] if asked else None}], "usage": USAGE}
            return httpx.Response(200, json={**whole, "prompt_token_ids": [1, 2] if asked else None})
        first = {"choices": [{"text": "a", "token_ids": ids[0]}], "prompt_token_ids": [1, 2] if asked else None}
        chunks = [
            b"data: " + json.dumps(first).encode() + b"\n\n",
            b"data: " + json.dumps({"choices": [{"text": "b", "token_ids": ids[1]}]}).encode()[:20],  # split event
            json.dumps({"choices": [{"text": "b", "token_ids": ids[1]}]}).encode()[20:] + b"\n\n",
            b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks_of(chunks))

    return handle


def tokenizing(retokenized: list[int], otherwise: Any) -> Any:
    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(retokenized), "tokens": retokenized, "max_model_len": 64})
        answer: httpx.Response = await otherwise(request, body)
        return answer

    return handle


async def checked_dispatch(
    body: dict[str, Any], retokenized: list[int], prefill_up: bool = True
) -> tuple[FakeWorkers, Checking, bytes]:
    workers = FakeWorkers(
        {"p0": tokenizing(retokenized, prefill_ok()), "d1": tokenizing(retokenized, answers_with_token_ids())}
    )
    if not prefill_up:
        workers.down.add("p0")
    s = build_settings({"prefill": [P0], "decode": ["http://d1:8200"]})
    decider = Checking()
    pool = Pool((*s.prefill, *s.decode), Metrics())
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    dispatcher = Dispatcher(s, pool, HttpxLegs(client), Metrics(), TimingLog(10), decider=decider)
    answer = await dispatcher.handle(call_of(dispatcher, body))
    got = b"".join(await relay(answer)) if isinstance(answer, StreamAnswer) else answer.content
    for _ in range(100):  # the check runs as its own task: let it finish
        if decider.settled:
            break
        await asyncio.sleep(0)
    await dispatcher.aclose()
    return workers, decider, got


@pytest.mark.parametrize("stream", [True, False])
async def test_the_decider_gets_the_answers_token_ids_and_the_client_does_not(stream: bool) -> None:
    workers, decider, got = await checked_dispatch({**BODY, "stream": stream}, [5, 6])
    (leg,), (check,) = workers.legs("d1"), workers.legs("p0")  # the prefill tokenizes: the same model
    assert leg.body["return_token_ids"] is True and check.path == "/tokenize"
    assert check.body == {"prompt": "ab", "add_special_tokens": False}
    (outcome,) = decider.outcomes
    assert (outcome.answer, outcome.answer_token_ids) == ("ab", (5, 6))
    assert decider.settled == [1]  # "ab" re-tokenizes as generated: all but the last token match
    assert b"[5" not in got and b"[1,2]" not in got.replace(b" ", b"") and re.search(rb'"token_ids": ?null', got)
    if stream:
        assert got.count(b"\n\n") == 4 and b'"text": "b"' in got  # the split event arrived whole


async def test_a_client_that_asks_for_token_ids_gets_them() -> None:
    _, decider, got = await checked_dispatch({**BODY, "return_token_ids": True}, [5, 7])
    assert b'"token_ids": [5]' in got and b'"prompt_token_ids": [1, 2]' in got
    assert decider.settled == [1]


@pytest.mark.parametrize("route", [Route.BYPASS, Route.PUSH])
async def test_answer_checks_are_shared_by_the_prefill_workers_as_the_prompts_are(route: Route) -> None:
    """A turn prefill served is checked there (the prefill policy chose it); a turn decode served alone goes to
    the least busy prefill worker, in turn: never every check on the first one."""
    workers = FakeWorkers(
        {
            "p0": tokenizing([5, 6], prefill_ok()),
            "p1": tokenizing([5, 6], prefill_ok("p1")),
            "d1": answers_with_token_ids(),
        }
    )
    decider = Checking(route)
    dispatcher, _, _ = await make(
        workers,
        decider,
        prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"],
        decode=["http://d1:8200"],
        prefill_policy="round-robin",
    )
    for _ in range(4):
        answer = await dispatcher.handle(call_of(dispatcher))
        if isinstance(answer, StreamAnswer):
            await relay(answer)
    for _ in range(100):  # the checks run as their own tasks: let them finish
        if len(decider.settled) == 4:
            break
        await asyncio.sleep(0)
    await dispatcher.aclose()
    served = ["/v1/completions", "/tokenize"] if route is Route.PUSH else ["/tokenize"]
    for prefill in ("p0", "p1"):
        assert [seen.path for seen in workers.legs(prefill)] == served * 2
    assert decider.settled == [1] * 4


async def test_without_a_healthy_prefill_the_decode_worker_checks_its_answer() -> None:
    workers, decider, _ = await checked_dispatch(BODY, [5, 6], prefill_up=False)
    assert [seen.path for seen in workers.legs("d1")] == ["/v1/completions", "/tokenize"]
    assert decider.settled == [1]


async def test_a_decode_error_that_beats_the_dying_prefills_reset_blames_the_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P dies: D's error (its KV never came) reaches the router before P's connection reset. The prefill is the
    root cause: the attempt is retried on another prefill and the decode is not reported to its health."""
    decode_failed = asyncio.Event()
    kv = asyncio.Event()
    answers = 0

    async def dying(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await decode_failed.wait()  # the router has read decode's error; only now does P's reset arrive
        raise httpx.ReadError("connection reset by peer", request=request)

    async def decode(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        nonlocal answers
        answers += 1
        if answers > 1:
            return await decode_ok(kv=kv)(request, body)
        event = json.dumps({"error": {"message": "KV never came", "type": "InternalServerError", "code": 500}})

        async def events() -> AsyncIterator[bytes]:
            try:
                yield f"data: {event}\n\n".encode()
            finally:
                decode_failed.set()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    workers = FakeWorkers({"p0": dying, "p1": prefill_ok("p1", done=kv), "d0": decode})
    dispatcher, pool, timings = await make(
        workers, prefill=[P0, "http://p1:8100,engine_id=p1,side_port=5601"], prefill_policy="round-robin"
    )
    reports = spy_reports(pool, monkeypatch)
    async with asyncio.timeout(10):  # hang guard
        events = await relay(await dispatcher.handle(call_of(dispatcher)))
    assert events[-1] == b"data: [DONE]\n\n"
    assert timings.query()[0]["attempts"] == 2 and timings.query()[0]["outcome"] == "ok"
    assert ("http://d0:8200", False) not in reports, "decode was blamed for the prefill's death"
    assert ("http://p0:8100", False) in reports


async def test_a_decode_error_with_a_prefill_that_answered_is_decodes_own_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = FakeWorkers({"p0": prefill_ok(), "d0": decode_error_event("engine bug"), "d1": decode_ok()})
    dispatcher, pool, timings = await make(
        workers, decode=["http://d0:8200", "http://d1:8200"], decode_policy="round-robin"
    )
    reports = spy_reports(pool, monkeypatch)
    await relay(await dispatcher.handle(call_of(dispatcher)))
    assert ("http://d0:8200", False) in reports and ("http://p0:8100", False) not in reports
    assert timings.query()[0]["attempts"] == 2


def spy_reports(pool: Pool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every passive health report the pool gets, as (worker, ok), while it still acts on them."""
    reports: list[tuple[str, bool]] = []
    report = pool.report

    def spy(wid: str, **kw: Any) -> None:
        reports.append((wid, kw["ok"]))
        report(wid, **kw)

    monkeypatch.setattr(pool, "report", spy)
    return reports
