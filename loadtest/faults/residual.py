"""The hung-prefill residual (issue 42 item 5), measured, on bed `vllm-preempt`: its p1 takes many seconds over a
ten-block prompt (2 tokens a step), so a SIGSTOP lands while the push is under way, with decode registered and
holding blocks for it, and before P's Done.

The router gives up on the hung prefill (its health check loses the worker) and closes decode's leg; p1 is the
router's only prefill, so the client gets a clear error. The row keeps p1 stopped until decode holds nothing (or
the bed's hold deadline and a margin pass), then resumes it, and reports how long decode held its blocks after
the client's outcome: decode may free them only on P's Done, CancelAck or Failure, or at its hold deadline
(connector/rendezvous/prefill.py, guarantee G2), and a stopped P sends nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtest.faults import client
from loadtest.faults.bed import KV_TIMEOUT_S, Bed, Worker
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome
from loadtest.faults.sustained import PREEMPT_WORDS, counters

PARTIAL = {"partial": "vllm:kvpush_partial_writes_total"}


def _until(check: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `check` holds (None: not within `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def _holds(worker: Worker) -> bool:
    with httpx.Client() as http:
        return not worker.state(http).idle


def hung_mid_push(bed: Bed, row: FaultRow) -> FaultOutcome:
    p1, decode = bed.prefills[1], bed.decodes[0]
    before = counters(p1, PARTIAL)["partial"]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.request, bed.router.url, client.body(16, False, PREEMPT_WORDS))
        started = _until(lambda: counters(p1, PARTIAL)["partial"] > before or pending.done(), 120.0)
        if started is None or pending.done():
            return FaultOutcome("the push ended before the hang", False, float("inf"))
        p1.hang()
        t_fault = time.monotonic()
        try:
            result = pending.result()
            held_at_outcome = _holds(decode)
            freed = _until(lambda: not _holds(decode), KV_TIMEOUT_S + 15.0)
            t_freed = time.monotonic()
        finally:
            p1.resume()
    when = "still held" if freed is None else f"{freed:.1f} s after it ({t_freed - t_fault:.1f} s after the hang)"
    note = (
        f"decode held blocks at the client's outcome: {'yes' if held_at_outcome else 'no'}; freed {when}; "
        f"the bed's kv_timeout_s is {KV_TIMEOUT_S:g} s; p1 stayed stopped until then"
    )
    outcome = FaultOutcome(client.summary([result]), result.acceptable, result.t_end - t_fault, note)
    outcome.acceptable = outcome.acceptable and freed is not None
    return outcome


RESIDUAL: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {"hung-mid-push": hung_mid_push}
