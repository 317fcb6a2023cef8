"""router/finish.py: a request's end is counted once; a detached prefill leg outlives only an "ok" end."""

from __future__ import annotations

import asyncio

from router.finish import Finisher
from router.metrics import Metrics
from router.timings import RequestRecord, TimingLog


def record(pairing_id: str = "p-1") -> RequestRecord:
    return RequestRecord("r-1", "completions", "push", stream=True, t_start=1.0, pairing_id=pairing_id)


def test_a_request_is_finished_once() -> None:
    timings = TimingLog(10)
    finisher = Finisher(Metrics(), timings, clock=lambda: 3.0)
    rec = record()
    finisher.finish(rec, "ok")
    finisher.finish(rec, "client_gone")  # a stream that closed as the request was given up
    assert (rec.outcome, rec.t_end) == ("ok", 3.0)
    assert [r["outcome"] for r in timings.query(request_id="r-1")] == ["ok"]


async def test_a_detached_prefill_leg_is_cancelled_unless_the_request_ended_ok() -> None:
    finisher = Finisher(Metrics(), TimingLog(10), clock=lambda: 2.0)
    kept, cut = (asyncio.create_task(asyncio.sleep(3600)) for _ in range(2))
    finisher.detach("p-ok", kept)
    finisher.detach("p-gone", cut)
    finisher.finish(record("p-ok"), "ok")
    finisher.finish(record("p-gone"), "client_gone")
    await asyncio.sleep(0)
    assert cut.cancelled() and not kept.done()
    await finisher.aclose()  # the router's close cancels what still runs
    assert kept.cancelled()
