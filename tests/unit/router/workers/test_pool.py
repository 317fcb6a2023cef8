"""Pool membership: joins and leaves, in-flight accounting across a leave, passive ejection, readiness, legs told
when their worker is lost, and the active probes (a hung worker, a slow one, a probe that raises)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.config import Settings
from router.domain import Role, WorkerSpec
from router.metrics import Metrics
from router.workers.health import HealthPolicy
from router.workers.pool import Loss, Pool

P0, P1 = WorkerSpec("http://p0:1", Role.PREFILL), WorkerSpec("http://p1:1", Role.PREFILL)
D0 = WorkerSpec("http://d0:1", Role.DECODE)


def healthy_pool(*specs: WorkerSpec) -> Pool:
    pool = Pool(specs, Metrics())
    for spec in specs:
        pool.get(spec.id).health.on_probe_ok(0.0)
    return pool


def test_ready_needs_a_healthy_worker_in_each_role() -> None:
    pool = healthy_pool(P0, D0)
    assert pool.ready()
    pool.report(D0.id, ok=False, hard=True, reason="refused")
    assert not pool.ready()
    assert pool.candidates(Role.PREFILL)[0].id == P0.id


def test_members_join_unknown_and_leave_at_once() -> None:
    pool = healthy_pool(P0, D0)
    pool.set_members(Role.PREFILL, [P1])
    assert pool.members(Role.PREFILL) == [P1]
    assert pool.candidates(Role.PREFILL) == []  # joined, not yet probed
    assert pool.members(Role.DECODE) == [D0]


def test_a_leg_in_flight_on_a_leaving_worker_finishes_cleanly() -> None:
    pool = healthy_pool(P0, P1, D0)
    with pool.track(P0.id, 100):
        assert pool.get(P0.id).in_flight == 1
        pool.set_members(Role.PREFILL, [P1])
    assert pool.members(Role.PREFILL) == [P1]
    pool.report(P0.id, ok=False, hard=True, reason="gone")  # a late failure report for a departed worker is ignored


def test_tracking_counts_requests_and_tokens() -> None:
    pool = healthy_pool(P0, D0)
    with pool.track(P0.id, 50), pool.track(P0.id, 25):
        (view,) = pool.candidates(Role.PREFILL)
        assert (view.in_flight, view.outstanding_tokens) == (2, 75)
    (view,) = pool.candidates(Role.PREFILL)
    assert (view.in_flight, view.outstanding_tokens) == (0, 0)


def test_ready_without_prefill_when_the_fallback_serves_decode_alone() -> None:
    pool = healthy_pool(P0, D0)
    pool.report(P0.id, ok=False, hard=True, reason="refused")
    assert not pool.ready() and pool.ready(prefill_needed=False)


# ------------------------------------------------------------------------------------------ legs told they are lost


def test_a_leg_is_told_at_once_when_its_worker_is_ejected() -> None:
    pool = healthy_pool(P0, P1, D0)
    with pool.track(P0.id, 10) as leg, pool.track(P1.id, 10) as other:
        assert not leg.is_lost
        pool.report(P0.id, ok=False, hard=False, reason="HTTP 500")
        assert not leg.is_lost, "one soft failure does not eject"
        pool.report(P0.id, ok=False, hard=True, reason="connection refused")
        assert leg.is_lost and leg.loss is Loss.DOWN and "connection refused" in leg.reason
        assert not other.is_lost, "only legs on the ejected worker"


def test_a_leg_is_told_when_its_worker_is_drained_or_leaves() -> None:
    pool = healthy_pool(P0, P1, D0)
    with pool.track(P0.id, 1) as drained, pool.track(P1.id, 1) as removed, pool.track(D0.id, 1) as decode:
        pool.drain(P0.id)
        pool.set_members(Role.PREFILL, [P0])
        assert (drained.loss, removed.loss) == (Loss.DRAINED, Loss.REMOVED)
        pool.remove(D0.id)
        assert decode.loss is Loss.REMOVED and decode.is_lost
    assert pool.get(P0.id).legs == set()


def test_a_leg_begun_on_a_worker_that_is_no_longer_usable_is_lost_from_the_start() -> None:
    pool = healthy_pool(P0, D0)
    pool.report(P0.id, ok=False, hard=True, reason="refused")
    with pool.track(P0.id, 1) as leg:
        assert leg.is_lost and leg.loss is Loss.DOWN
    pool.drain(D0.id)
    with pool.track(D0.id, 1) as leg:
        assert leg.loss is Loss.DRAINED


def test_a_finished_leg_is_not_told_later() -> None:
    pool = healthy_pool(P0, D0)
    with pool.track(P0.id, 1) as leg:
        pass
    pool.report(P0.id, ok=False, hard=True, reason="refused")
    assert not leg.is_lost


# ------------------------------------------------------------------------------------------------ active probes


class Workers:
    """Stand-in /health answers by host: "ok", "refuse", "hang" (never answers), "raise" (not an httpx error)."""

    def __init__(self, **behaviour: list[str]) -> None:
        self.script = behaviour  # per host, one entry per probe; the last one repeats
        self.probes: dict[str, int] = {}

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self._handle))

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        n = self.probes[host] = self.probes.get(host, 0) + 1
        script = self.script.get(host, ["ok"])
        what = script[min(n, len(script)) - 1]
        if what == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if what == "hang":  # a SIGSTOPped worker: the connection opens, nothing ever answers
            await asyncio.get_running_loop().create_future()
        if what == "raise":
            raise ValueError("Cannot combine AUTHORIZATION header with AUTH argument or credentials encoded in URL")
        return httpx.Response(200)


async def test_a_hung_worker_is_marked_down_by_two_probe_timeouts_and_its_legs_are_told() -> None:
    pool = healthy_pool(P0, P1, D0)
    workers = Workers(p0=["hang"])
    async with workers.client() as client:
        with pool.track(P0.id, 100) as leg:
            await pool.probe_all(client, timeout=0.05)
            assert leg.is_lost and leg.loss is Loss.DOWN and "no answer within" in leg.reason
    assert workers.probes["p0"] == 2, "the first timeout was confirmed by a second probe at once"
    assert [v.id for v in pool.candidates(Role.PREFILL)] == [P1.id]


async def test_one_slow_probe_does_not_take_a_busy_worker_down() -> None:
    pool = healthy_pool(P0, D0)
    workers = Workers(p0=["hang", "ok"])
    async with workers.client() as client:
        with pool.track(P0.id, 100_000) as leg:  # a long prefill in flight
            await pool.probe_all(client, timeout=0.05)
            assert not leg.is_lost
    assert workers.probes["p0"] == 2 and pool.get(P0.id).healthy


async def test_a_probe_that_raises_a_non_httpx_error_marks_the_worker_down_and_is_reported() -> None:
    pool = healthy_pool(P0, D0)
    errors: list[tuple[str, str]] = []
    async with Workers(d0=["raise"]).client() as client:
        await pool.probe_all(client, 1.0, on_error=lambda spec, exc: errors.append((spec.id, type(exc).__name__)))
    assert errors == [(D0.id, "ValueError")] and not pool.get(D0.id).healthy


async def test_the_health_loop_survives_a_probe_that_raises_and_brings_workers_back() -> None:
    pool = healthy_pool(P0, D0)
    workers = Workers(d0=["ok", "raise", "raise", "ok"], p0=["ok", "refuse", "ok"])
    rounds: list[tuple[bool, bool]] = []

    async def sleep(_: float) -> None:
        rounds.append((pool.get(P0.id).healthy, pool.get(D0.id).healthy))
        if len(rounds) == 5:
            raise asyncio.CancelledError

    async with workers.client() as client:
        with pytest.raises(asyncio.CancelledError):
            await pool.run_health(client, 0.01, 1.0, sleep=sleep)
    assert rounds == [(True, True), (False, False), (True, False), (True, True), (True, True)]


def test_the_default_health_settings_mark_a_hung_worker_down_within_3_s() -> None:
    """Worst case: the hang begins just after an answered probe; the next round starts `health_interval` later and
    needs `probe_timeouts` timeouts of `timeouts.health` each."""
    s, policy = Settings(), HealthPolicy()
    assert s.health_interval + policy.probe_timeouts * s.timeouts.health <= 3.0
    assert policy.probe_timeouts >= 2, "one slow answer alone must not cost a busy worker its legs"


async def test_probe_rounds_start_at_a_fixed_rate_so_a_hung_worker_does_not_slow_the_others() -> None:
    pool = healthy_pool(P0, D0)
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        raise asyncio.CancelledError

    async with Workers(p0=["hang"]).client() as client:
        with pytest.raises(asyncio.CancelledError):
            await pool.run_health(client, 10.0, 0.05, sleep=sleep)
    # the round took at least the two 0.05 s timeouts; the pause after it is shortened by what the round took
    assert len(delays) == 1 and 0.0 <= delays[0] <= 10.0 - 2 * 0.05


async def test_the_pool_says_when_a_worker_goes_down_or_leaves_and_not_when_it_is_drained() -> None:
    """on_gone feeds the P/D decider's forget: a worker down (probe or passive) or gone lost its cache."""
    gone: list[str] = []
    d1 = WorkerSpec("http://d1:1", Role.DECODE)
    pool = Pool((P0, P1, D0, d1), Metrics(), on_gone=gone.append)
    for spec in (P0, P1, D0, d1):
        pool.get(spec.id).health.on_probe_ok(0.0)
    async with Workers(p0=["refuse"]).client() as client:
        await pool.probe_all(client, timeout=0.05)
        await pool.probe_all(client, timeout=0.05)  # still down: told once
    assert gone == [P0.id], "the probe took p0 down"
    pool.report(P1.id, ok=False, hard=True, reason="connection refused")
    assert gone == [P0.id, P1.id], "passive ejection"
    pool.drain(D0.id)
    assert gone == [P0.id, P1.id], "a drained worker keeps its cache"
    pool.set_members(Role.DECODE, [D0])
    assert gone == [P0.id, P1.id, d1.id], "discovery dropped d1"
    pool.remove(D0.id)
    assert gone[-1] == D0.id


# ---------------------------------------------------------------------- a stalled prefill (a hung TP rank, issue 42)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


STALL = HealthPolicy(stall_base=5.0, stall_per_token=0.0)


def test_a_prefill_up_to_its_probes_that_answers_no_leg_is_held_out_and_its_legs_told() -> None:
    """A SIGSTOPped TP rank: the API process answers /health, the engine answers nothing. Before the stall rule
    nothing took such a prefill out (its failures came back as decode's errors), so new legs kept going to it."""
    clock = Clock()
    pool = Pool((P0, P1, D0), Metrics(), STALL, clock)
    for spec in (P0, P1, D0):
        pool.get(spec.id).health.on_probe_ok(clock.now)
    with pool.track(P0.id, 100) as hung, pool.track(P1.id, 100), pool.track(D0.id, 100) as stream:
        clock.now += 5.0
        pool.check_stalls()
        assert not hung.is_lost, "within the budget"
        pool.report(P1.id, ok=True)  # p1 answers its legs: progress
        clock.now += 0.5
        pool.check_stalls()
        assert hung.is_lost and hung.loss is Loss.DOWN and "stalled" in hung.reason
        assert [v.id for v in pool.candidates(Role.PREFILL)] == [P1.id], "new requests go to p1"
        assert not stream.is_lost, "decode legs (long streams) are not judged by the prefill rule"


def test_an_idle_prefill_or_one_that_answers_is_never_stalled() -> None:
    clock = Clock()
    pool = Pool((P0, D0), Metrics(), STALL, clock)
    pool.get(P0.id).health.on_probe_ok(clock.now)
    clock.now += 1000.0
    pool.check_stalls()
    with pool.track(P0.id, 100) as long_leg:
        for _ in range(10):
            clock.now += 4.0
            with pool.track(P0.id, 1):
                pass
            pool.report(P0.id, ok=True)
            pool.check_stalls()
        assert not long_leg.is_lost, "a long leg on an engine that answers others meanwhile is not a stall"
    assert pool.candidates(Role.PREFILL)


def test_a_stalled_data_parallel_rank_is_held_out_alone() -> None:
    clock = Clock()
    dp = WorkerSpec("http://pdp:1", Role.PREFILL, dp_size=2)
    pool = Pool((dp, D0), Metrics(), STALL, clock)
    pool.get(dp.id).health.on_probe_ok(clock.now)
    with pool.track(dp.id, 10, rank=1) as hung, pool.track(dp.id, 10, rank=0) as fine:
        clock.now += 4.0
        pool.report_rank(dp.id, 0, ok=True)
        clock.now += 2.0
        pool.check_stalls()
        assert hung.is_lost and not fine.is_lost
    views = {v.rank: v.usable for v in pool.get(dp.id).ranks.views(clock.now)}
    assert views == {0: True, 1: False}
    assert pool.candidates(Role.PREFILL), "the worker stays a candidate on its other rank"
