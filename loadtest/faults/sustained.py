"""Rows under sustained load (issue 42): many requests over a while, not a handful, with the fault inside the load.

`preempt_under_load`: clients keep a chunked, small-cache prefill (bed `vllm-preempt`) full of ten-block prompts,
so vLLM preempts prefill legs after their partial WRITEs; every answer must equal one plain instance's (p0, not
routed) or fail with a clear error. `replica_kill`: a second router replica over the same engines is killed
(SIGKILL) with streams in flight on both replicas and a steady rate on the bed's router: the victim's clients see
a cut, the survivor's see nothing. What the bed holds afterwards is the runner's check (matrix.observe).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest import promtext
from loadtest.faults import client
from loadtest.faults.bed import Bed, RouterProc, Worker, start_router
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome

PREEMPT_CLIENTS = 4  # twice p1's --max-num-seqs: two prompts always advance together, two wait
PREEMPT_LOAD_S = 40.0  # new requests start until then; the last ones finish after it
PREEMPT_WORDS = 95  # about 1170 prompt tokens: ten of p1's 128-token blocks (16 usable)
REPLICA_RATE = 2.0  # requests a second through the surviving replica during the replica row
REPLICA_LOAD_S = 8.0  # of which 3 s before the kill
P1_COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "partial WRITEs": "vllm:kvpush_partial_writes_total",
    "fences": "vllm:kvpush_preemption_fences_total",
    "fence timeouts": "vllm:kvpush_preemption_fence_timeouts_total",
    "failed transfers": "vllm:kvpush_failed_transfers_total",
}


@dataclass
class Answer:
    """One non-streamed completion as its client saw it, with the text to compare."""

    payload: dict[str, Any]
    status: int | None
    text: str | None
    error: str | None
    t_start: float
    t_end: float

    @property
    def clear_failure(self) -> bool:
        return self.status is not None and self.status >= 500 and self.error is not None


def complete(url: str, payload: dict[str, Any]) -> Answer:
    """One non-streamed completion; a network failure is an outcome (status None), never raised."""
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", json=payload, timeout=client.GUARD)
    except httpx.HTTPError as exc:
        return Answer(payload, None, None, type(exc).__name__, t0, time.monotonic())
    t1 = time.monotonic()
    try:
        data = r.json()
    except ValueError:
        return Answer(payload, r.status_code, None, None, t0, t1)
    if r.status_code == 200 and data.get("choices"):
        return Answer(payload, 200, str(data["choices"][0]["text"]), None, t0, t1)
    error = data.get("error") if isinstance(data, dict) else None
    kind = str(error.get("type") or error.get("message")) if isinstance(error, dict) else None
    return Answer(payload, r.status_code, None, kind, t0, t1)


def counters(worker: Worker, names: dict[str, str]) -> dict[str, float]:
    with httpx.Client() as http:
        samples = promtext.parse(http.get(f"{worker.url}/metrics", timeout=5.0).text)
    return {label: promtext.total(samples, name) for label, name in names.items()}


def _client_loop(url: str, until: float) -> list[Answer]:
    answers = []
    while time.monotonic() < until:
        answers.append(complete(url, client.body(max_tokens=8, stream=False, words=PREEMPT_WORDS)))
    return answers


def judge_preemption(answers: list[Answer], reference: dict[int, str | None], moved: dict[str, float]) -> FaultOutcome:
    """Pure: served answers equal to the single instance's (`reference`, by index), the rest failed clearly, and
    vLLM did preempt (a run without a preemption tested nothing)."""
    equal = sum(1 for i, a in enumerate(answers) if a.status == 200 and a.text == reference.get(i))
    differ = sum(1 for i, a in enumerate(answers) if a.status == 200 and a.text != reference.get(i))
    clear = sum(1 for a in answers if a.clear_failure)
    unclear = len(answers) - equal - differ - clear
    counts = (("200 equal", equal), ("200 differ", differ), ("5xx with error", clear), ("unclear", unclear))
    parts = [f"{k} x{v}" for k, v in counts if v]
    slowest = max((a.t_end - a.t_start for a in answers), default=0.0)
    span = (max(a.t_end for a in answers) - min(a.t_start for a in answers)) if answers else 0.0
    note = (
        f"{len(answers)} requests from {PREEMPT_CLIENTS} clients over {span:.0f} s "
        f"({len(answers) / span if span else 0.0:.2f}/s); on p1: "
        + ", ".join(f"{k} +{v:g}" for k, v in moved.items())
        + "; time is the slowest request's"
    )
    ok = differ == 0 and unclear == 0 and equal > 0 and moved["preemptions"] > 0
    return FaultOutcome(", ".join(parts) or "no request ran", ok, slowest, note)


def preempt_under_load(bed: Bed, row: FaultRow) -> FaultOutcome:
    """The fault is vLLM's own preemption, forced by p1's small KV cache under steady demand."""
    p0, p1 = bed.prefills
    before = counters(p1, P1_COUNTERS)
    until = time.monotonic() + PREEMPT_LOAD_S
    with ThreadPoolExecutor(PREEMPT_CLIENTS) as pool:
        loops = [pool.submit(_client_loop, bed.router.url, until) for _ in range(PREEMPT_CLIENTS)]
        answers = [a for f in loops for a in f.result()]
    after = counters(p1, P1_COUNTERS)
    reference = {i: complete(p0.url, a.payload).text for i, a in enumerate(answers) if a.status == 200}
    return judge_preemption(answers, reference, {k: after[k] - before[k] for k in P1_COUNTERS})


def _steady(url: str, rate: float, seconds: float, make: Callable[[], dict[str, Any]]) -> list[Future[client.Result]]:
    """Requests at a steady `rate` for `seconds` (each on its own thread: a slow one does not delay the next)."""
    pool = ThreadPoolExecutor(max(1, int(rate * seconds) + 1))
    futures: list[Future[client.Result]] = []
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        futures.append(pool.submit(client.request, url, make()))
    pool.shutdown(wait=False)
    return futures


def _wait_in_flight(router: RouterProc, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline and router.gauges(http)["in_flight"] < n:
            time.sleep(0.05)


def _engines_idle(bed: Bed, since: float, timeout: float = 150.0) -> float:
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            if all(w.state(http).idle for w in bed.workers):
                return time.monotonic() - since
            time.sleep(0.1)
    return float("inf")


def judge_replica(victims: list[client.Result], survivors: list[client.Result], t_fault: float) -> FaultOutcome:
    """Pure: every client of the killed replica saw its stream cut (there is nobody left to send an error; a
    client without an answer means the kill came before the streams did), every survivor's was served in full."""
    cut = all(r.status == 200 and not r.complete for r in victims)
    served = sum(1 for r in survivors if r.status == 200 and r.complete)
    ok = cut and served == len(survivors) and bool(victims)
    summary = (
        f"victim: {client.summary(victims)}; survivor: {client.summary(survivors)}"
        if victims
        else "no victim client ran"
    )
    last_cut = max((r.t_end for r in victims), default=t_fault)
    note = f"survivor's clients served {served} of {len(survivors)} (rate {REPLICA_RATE:g}/s over {REPLICA_LOAD_S:g} s)"
    return FaultOutcome(summary, ok, max(0.0, last_cut - t_fault), note)


def replica_kill(bed: Bed, row: FaultRow) -> FaultOutcome:
    """The victim is a second replica (the bed's router survives for the later rows)."""
    prefills = [w.router_arg for w in bed.prefills]
    victim = start_router(prefills, [w.router_arg for w in bed.decodes], bed.router.config, bed.started)
    try:
        # The victim's streams would run long after the survivor's load (1200 tokens): once that load is over,
        # engines idle means they let go of the dead replica's legs, not that those legs ran out.
        victims = _clients(victim.url, 3, lambda: client.body(max_tokens=1200, words=60))
        survivors = _clients(bed.router.url, 3, lambda: client.body(max_tokens=200, words=60))
        load: list[Future[client.Result]] = []
        with ThreadPoolExecutor(1) as side:
            steady = side.submit(_steady, bed.router.url, REPLICA_RATE, REPLICA_LOAD_S, client.body)
            _wait_in_flight(victim, 3)
            time.sleep(3.0)  # the streams are flowing and the steady load is under way
            pid = victim.handle.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            t_fault = time.monotonic()
            load = steady.result()
        victim_results = [f.result() for f in victims]
        survivor_results = [f.result() for f in [*survivors, *load]]
        outcome = judge_replica(victim_results, survivor_results, t_fault)
        idle = _engines_idle(bed, t_fault)
        outcome.note += f"; every engine idle {idle:.2f} s after the kill (the survivor's load included)"
        return outcome
    finally:
        bed.started.remove(victim.handle)
        victim.handle.stop(10.0)


def _clients(url: str, n: int, make: Callable[[], dict[str, Any]]) -> list[Future[client.Result]]:
    pool = ThreadPoolExecutor(max(1, n))
    futures = [pool.submit(client.request, url, make()) for _ in range(n)]
    pool.shutdown(wait=False)
    return futures


SUSTAINED: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {
    "preempt-under-load": preempt_under_load,
    "replica-kill": replica_kill,
}
