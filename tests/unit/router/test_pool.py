"""Pool membership: joins and leaves, in-flight accounting across a leave, passive ejection, readiness."""

from __future__ import annotations

from router.domain import Role, WorkerSpec
from router.metrics import Metrics
from router.pool import Pool

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
