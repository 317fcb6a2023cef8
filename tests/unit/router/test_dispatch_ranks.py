"""Data-parallel servers through the dispatcher: prefill's rank pinned with X-data-parallel-rank and decode given
that rank's identity (`<engine_id>_dp<r>`, side port base + r), configured or learned per rank; requests spread
evenly over the ranks; a rank that fails held out alone; decode's rank pinned only under a load-aware policy;
a pair of unequal block sizes refused before any leg; a gateway's named prefill honoured."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest

from router.answer import JsonAnswer, StreamAnswer
from router.config import build_settings
from router.dispatch import ClientRequest, Dispatcher
from router.domain import Endpoint, EngineLoad, Role
from router.errors import Unpairable, UpstreamProtocolError
from router.legs.httpx import HttpxLegs
from router.metrics import Metrics
from router.protocol import parse_request
from router.timings import TimingLog
from router.workers.health import HealthPolicy
from router.workers.pool import Pool
from router.workers.ranks import RANK_HEADER
from tests.unit.router.fake_workers import FakeWorkers, Handler, decode_ok, prefill_ok

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True}
P_URL = "http://p0:8100"


def dp_prefill(base: str = "p0", failing: frozenset[int] = frozenset(), honour: bool = True) -> Handler:
    """A DP prefill server: answers as the rank the header names (rank 0 without it, or always 0 when it does
    not honour the header); ranks in `failing` answer 500."""

    async def handle(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        rank = int(request.headers.get(RANK_HEADER, "0")) if honour else 0
        if rank in failing:
            return httpx.Response(500, json={"error": {"message": "engine dead", "type": "x", "code": 500}})
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"{base}_dp{rank}",
            "remote_host": "127.0.0.9",
            "remote_port": 5600 + rank,
            "tp_size": 1,
            "pp_size": 1,
            "remote_block_ids": [[1, 2]],
            "remote_request_id": "cmpl-x",
            "transfer_mode": "push",
        }
        return httpx.Response(200, json={"id": "cmpl-p", "choices": [{"text": "a"}], "kv_transfer_params": params})

    return handle


async def make(workers: FakeWorkers, **settings: Any) -> tuple[Dispatcher, Pool, TimingLog]:
    layers: dict[str, Any] = {"prefill": [f"{P_URL},engine_id=p0,side_host=127.0.0.9,side_port=5600,dp=2"]}
    layers["decode"] = ["http://d0:8200"]
    s = build_settings(layers, settings)
    metrics, timings = Metrics(), TimingLog(100)
    policy = HealthPolicy(s.eject_after, s.eject_backoff, s.eject_backoff_max)
    pool = Pool((*s.prefill, *s.decode), metrics, policy)
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    return Dispatcher(s, pool, HttpxLegs(client), metrics, timings), pool, timings


def call_of(dispatcher: Dispatcher, prefill: str | None = None) -> ClientRequest:
    info = parse_request(Endpoint.COMPLETIONS, BODY)
    return ClientRequest(body=BODY, info=info, record=dispatcher.new_record("client-1", info), prefill=prefill)


async def relay(answer: StreamAnswer | JsonAnswer) -> None:
    assert isinstance(answer, StreamAnswer)
    try:
        async for _ in answer.events():
            pass
    finally:
        await answer.aclose()


def pairs(workers: FakeWorkers) -> list[tuple[int, str, int]]:
    """(prefill's pinned rank, decode's remote_engine_id, remote_port) per request, in order."""
    prefills, decodes = workers.legs("p0"), workers.legs("d0")
    return [
        (
            int(p.headers[RANK_HEADER]),
            d.body["kv_transfer_params"]["remote_engine_id"],
            d.body["kv_transfer_params"]["remote_port"],
        )
        for p, d in zip(prefills, decodes, strict=True)
    ]


async def test_configured_ranks_pin_prefill_and_give_decode_that_rank_s_identity_both_legs_at_once() -> None:
    gate = asyncio.Event()
    workers = FakeWorkers({"p0": dp_prefill(), "d0": decode_ok(on_request=gate.set)})

    async def gated(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        await gate.wait()  # prefill answers only once decode has been sent: both legs left at once
        gate.clear()
        return await dp_prefill()(request, body)

    workers.handlers["p0"] = gated
    dispatcher, _, _ = await make(workers)
    for _ in range(8):
        await relay(await dispatcher.handle(call_of(dispatcher)))
    got = pairs(workers)
    assert all(engine == f"p0_dp{rank}" and port == 5600 + rank for rank, engine, port in got)
    assert Counter(rank for rank, _, _ in got) == {0: 4, 1: 4}  # uniform load: even
    assert all(RANK_HEADER not in d.headers for d in workers.legs("d0"))  # decode's own rank: the server's choice


async def test_learned_identities_are_per_rank() -> None:
    workers = FakeWorkers({"p0": dp_prefill("learned"), "d0": decode_ok()})
    dispatcher, pool, timings = await make(workers, prefill=[f"{P_URL},dp=2"])
    for _ in range(4):
        await relay(await dispatcher.handle(call_of(dispatcher)))
    ranks = pool.get(P_URL).ranks
    assert [ranks.identity(r).engine_id for r in (0, 1)] == ["learned_dp0", "learned_dp1"]  # type: ignore[union-attr]
    assert [ranks.identity(r).port for r in (0, 1)] == [5600, 5601]  # type: ignore[union-attr]
    records = timings.query()
    sequential = [r["prefill_done"] <= r["decode_sent"] for r in sorted(records, key=lambda r: r["t_start"])]
    assert sequential[:2] == [True, True]  # each rank's first request learns its identity
    assert all(e == f"learned_dp{r}" and p == 5600 + r for r, e, p in pairs(workers))


async def test_a_server_that_ignores_the_rank_header_is_a_clear_error_not_a_wrong_pairing() -> None:
    workers = FakeWorkers({"p0": dp_prefill(honour=False), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers, prefill=[f"{P_URL},dp=2"], retries=0)
    await relay(await dispatcher.handle(call_of(dispatcher)))  # pinned to rank 0: answered by rank 0
    with pytest.raises(UpstreamProtocolError, match="X-data-parallel-rank"):
        await dispatcher.handle(call_of(dispatcher))  # pinned to rank 1, answered by rank 0
    assert pool.get(P_URL).ranks.identity(1) is None


async def test_a_dp_server_configured_without_dp_is_a_clear_error() -> None:
    workers = FakeWorkers({"p0": dp_prefill(), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers, prefill=[P_URL], retries=0)
    with pytest.raises(UpstreamProtocolError, match="data-parallel size 1"):
        await dispatcher.handle(call_of(dispatcher))
    assert pool.get(P_URL).identity is None


async def test_a_failing_rank_is_held_out_alone_and_the_other_serves() -> None:
    workers = FakeWorkers({"p0": dp_prefill(failing=frozenset({1})), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers, eject_after=1, eject_backoff=60)
    for _ in range(6):  # push: the fake decode answers before the prefill leg fails (detached, then counted)
        await relay(await dispatcher.handle(call_of(dispatcher)))
        await asyncio.sleep(0)
    state = pool.get(P_URL)
    assert state.healthy  # the server itself stays in
    assert [v.usable for v in state.ranks.views(0.0)] == [True, False]
    ranks = [int(p.headers[RANK_HEADER]) for p in workers.legs("p0")]
    assert ranks.count(1) == 1 and ranks[-4:] == [0, 0, 0, 0]


async def test_a_refused_connection_takes_the_whole_server_out() -> None:
    workers = FakeWorkers({"p0": dp_prefill(), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers)
    workers.down.add("p0")
    await relay(await dispatcher.handle(call_of(dispatcher)))  # decode answered; the prefill leg was refused
    await asyncio.sleep(0)
    assert not pool.get(P_URL).healthy
    assert all(v.usable for v in pool.get(P_URL).ranks.views(0.0))  # no rank is blamed for the server's refusal


@pytest.mark.parametrize(("policy", "pinned"), [("least-loaded", True), ("round-robin", False)])
async def test_decode_s_rank_is_pinned_only_under_a_load_aware_policy(policy: str, pinned: bool) -> None:
    workers = FakeWorkers({"p0": dp_prefill(), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers, decode=["http://d0:8200,dp=2"], decode_policy=policy)
    pool.set_load("http://d0:8200", EngineLoad(5, 0, 0.1), {0: EngineLoad(5, 0, 0.1), 1: EngineLoad(0, 0, 0.0)})
    await relay(await dispatcher.handle(call_of(dispatcher)))
    (d_leg,) = workers.legs("d0")
    assert (d_leg.headers.get(RANK_HEADER) == "1") is pinned  # the least loaded rank
    assert (RANK_HEADER in d_leg.headers) is pinned


async def test_unequal_block_sizes_are_refused_before_any_leg() -> None:
    workers = FakeWorkers({"p0": dp_prefill(), "d0": decode_ok()})
    dispatcher, pool, _ = await make(workers, retries=0)
    pool.set_load(P_URL, EngineLoad(0, 0, 0.0), block_size=16)
    pool.set_load("http://d0:8200", EngineLoad(0, 0, 0.0), block_size=32)
    with pytest.raises(UpstreamProtocolError, match="block size 16") as caught:
        await dispatcher.handle(call_of(dispatcher))
    assert "http://" not in caught.value.message
    assert workers.seen == []


@pytest.mark.parametrize(
    ("prefill", "decode", "says"),
    [
        (f"{P_URL},engine_id=p0,side_port=5600,tp=2", "http://d0:8200,tp=3", "tensor_parallel_size 2 and the decode 3"),
        (P_URL, "http://d0:8200,tp=2", "did not state its tensor-parallel size"),  # learned; the answer lacks tp
    ],
)
async def test_a_pair_of_unservable_parallelism_is_a_503_before_the_decode_leg(
    prefill: str, decode: str, says: str
) -> None:
    async def no_tp(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        answer = await prefill_ok("p0")(request, body)
        payload = answer.json()
        payload["kv_transfer_params"].pop("tp_size", None)
        return httpx.Response(200, json=payload)

    workers = FakeWorkers({"p0": no_tp, "d0": decode_ok()})
    dispatcher, _, _ = await make(workers, prefill=[prefill], decode=[decode], retries=0)
    with pytest.raises(Unpairable, match=says) as caught:
        await dispatcher.handle(call_of(dispatcher))
    assert caught.value.status == 503 and "http://" not in caught.value.message
    assert workers.legs("d0") == []  # refused before decode was asked: never a hang


async def test_the_gateway_s_named_prefill_is_used() -> None:
    workers = FakeWorkers({"p0": dp_prefill(), "p1": prefill_ok("p1"), "d0": decode_ok()})
    s = build_settings(
        {
            "prefill": [f"{P_URL},engine_id=p0,side_port=5600,dp=2", "http://p1:8100,engine_id=p1,side_port=5600"],
            "decode": ["http://d0:8200"],
        }
    )
    pool = Pool((*s.prefill, *s.decode), Metrics())
    client = httpx.AsyncClient(transport=workers.transport())
    await pool.probe_all(client, 1.0)
    dispatcher = Dispatcher(s, pool, HttpxLegs(client), Metrics(), TimingLog(10))
    for _ in range(3):
        await relay(await dispatcher.handle(call_of(dispatcher, prefill="http://p1:8100")))
    assert len(workers.legs("p1")) == 3 and workers.legs("p0") == []
    assert {d.body["kv_transfer_params"]["remote_engine_id"] for d in workers.legs("d0")} == {"p1"}
    assert Role.PREFILL  # the named prefill is a pool member: gateway.py refused anything else before here
