"""One function per fault: inject it into a bed while clients run, and report what the clients got and how
long after the fault their last outcome came. Cleanliness afterwards is the runner's job (matrix.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from loadtest import promtext
from loadtest.faults import client
from loadtest.faults.bed import Bed, RouterProc, Worker, start_router
from loadtest.faults.rows import FaultRow
from stack.procs import free_port


@dataclass
class FaultOutcome:
    summary: str  # e.g. "200 x5, 503 x1"
    acceptable: bool  # every client was served or got a clear OpenAI-style error
    fault_to_outcome_s: float  # from the fault to the last client outcome (or to the router's release)
    note: str = ""


def _released(bed: Bed, since: float, router: RouterProc | None = None) -> float:
    """Waits until the router holds nothing for the client any more; returns seconds since `since`."""
    front = router or bed.router
    deadline = time.monotonic() + client.GUARD
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            gauges = front.gauges(http)
            if gauges["in_flight"] == 0 and gauges["worker_in_flight"] == 0:
                return time.monotonic() - since
            time.sleep(0.05)
    return float("inf")


def _clients(url: str, n: int, make: Callable[[], dict[str, object]]) -> list[Future[client.Result]]:
    pool = ThreadPoolExecutor(max(1, n))
    futures = [pool.submit(client.request, url, make()) for _ in range(n)]
    pool.shutdown(wait=False)
    return futures


def _outcome(results: list[client.Result], t_fault: float, note: str = "") -> FaultOutcome:
    last = max(r.t_end for r in results) if results else t_fault
    return FaultOutcome(client.summary(results), all(r.acceptable for r in results), max(0.0, last - t_fault), note)


def _wait_running(worker: Worker, clients: list[Future[client.Result]], timeout: float = 10.0) -> None:
    """Until the worker holds a request, or every one of `clients` has its answer (a fast engine may be done before
    we look: then there is nothing left to catch in flight, and waiting longer would only wait on the clock)."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline and not all(f.done() for f in clients):
            state = worker.state(http)
            if (state.running or 0) > 0:
                return
            time.sleep(0.01)


def standin_fault(bed: Bed, row: FaultRow) -> FaultOutcome:
    """The faulty stand-in is in the pool from the start: sequential requests, each must be served or fail
    clearly; the time is the slowest request's."""
    big = row.fault == "never-read"
    results, slowest = [], 0.0
    for _ in range(4):
        payload = client.body(stream=True)
        if big or row.fault == "slow-read":
            payload["prompt"] = "x" * (8 * 2**20 if big else 64 * 2**10)
        t0 = time.monotonic()
        result = client.request(bed.router.url, payload)
        results.append(result)
        slowest = max(slowest, result.t_end - t0)
    return FaultOutcome(client.summary(results), all(r.acceptable for r in results), slowest, "slowest request")


def hang(bed: Bed, row: FaultRow) -> FaultOutcome:
    victim = bed.of(row.target)[0]
    if row.target == "decode":  # hung before its first byte: the requests come after the hang
        victim.hang()
        t_fault = time.monotonic()
        futures = _clients(bed.router.url, 3, lambda: client.body(max_tokens=16))
    else:
        futures = _clients(bed.router.url, 3, lambda: client.body(max_tokens=16, words=120))
        _wait_running(victim, futures)
        victim.hang()
        t_fault = time.monotonic()
        futures += _clients(bed.router.url, 3, lambda: client.body(max_tokens=16))
    try:
        results = [f.result() for f in futures]
    finally:
        victim.resume()
    _await_ready(bed)
    return _outcome(results, t_fault)


def kill(bed: Bed, row: FaultRow) -> FaultOutcome:
    victim = bed.of(row.target)[-1]
    tokens = 200 if row.target == "decode" else 16
    futures = _clients(bed.router.url, 3, lambda: client.body(max_tokens=tokens, words=120))
    _wait_running(victim, futures)
    if row.target == "decode":
        time.sleep(0.5)  # let the streams start
    victim.kill()
    t_fault = time.monotonic()
    futures += _clients(bed.router.url, 3, lambda: client.body(max_tokens=16))
    return _outcome([f.result() for f in futures], t_fault)


def leave_before_first_byte(bed: Bed, row: FaultRow) -> FaultOutcome:
    t_fault = client.leave_before_first_byte(bed.router.url, client.body(max_tokens=200))
    return FaultOutcome("client gone", True, _released(bed, t_fault), "until the router released the request")


def leave_mid_stream(bed: Bed, row: FaultRow) -> FaultOutcome:
    t_fault = client.leave_mid_stream(bed.router.url, client.body(max_tokens=200))
    return FaultOutcome("client gone", True, _released(bed, t_fault), "until the router released the request")


def leave_mid_upload(bed: Bed, row: FaultRow) -> FaultOutcome:
    t_fault = client.leave_mid_upload(bed.router.url)
    return FaultOutcome("client gone", True, _released(bed, t_fault), "until the router released the request")


def slow_reader(bed: Bed, row: FaultRow) -> FaultOutcome:
    t0 = time.monotonic()
    result = client.slow_reader(bed.router.url, client.body(max_tokens=64))
    return FaultOutcome(client.summary([result]), result.acceptable, result.t_end - t0, "whole slow read")


def burst(bed: Bed, row: FaultRow) -> FaultOutcome:
    t0 = time.monotonic()
    results = [f.result() for f in _clients(bed.router.url, 48, lambda: client.body(max_tokens=16))]
    served = all(r.status in (200, 429) and r.acceptable for r in results)
    return FaultOutcome(
        client.summary(results),
        served and any(r.status == 429 for r in results),
        max(r.t_end for r in results) - t0,
        "last of the burst",
    )


def lost_registration(bed: Bed, row: FaultRow) -> FaultOutcome:
    """A second router names the prefills with an engine id and side port they do not have: decode registers
    for KV with a peer that is not there, and the prefill's finished KV waits for a registration that never
    comes. (A wrong side port alone was not enough on our connector: the KV still arrived.)"""
    wrong = [f"{w.url},engine_id=lost-{i},side_port={free_port()}" for i, w in enumerate(bed.prefills)]
    front = start_router(wrong, [w.url for w in bed.decodes], bed.router.config, bed.started)
    try:
        before = _prompt_sources(bed.decodes[0])
        t_fault = time.monotonic()
        results = [client.request(front.url, client.body(max_tokens=16))]
        _released(bed, t_fault, front)
        after = _prompt_sources(bed.decodes[0])
        moved = {k: after[k] - before[k] for k in after}
        note = ", ".join(f"{k} +{v:g}" for k, v in moved.items() if v) or "no prompt tokens counted"
        return _outcome(results, t_fault, f"decode's prompt tokens: {note}")
    finally:
        bed.started.remove(front.handle)
        front.handle.stop(10.0)


def _prompt_sources(worker: Worker) -> dict[str, float]:
    """vLLM's count of prompt tokens by where they came from (transferred KV, computed, prefix cache)."""
    if worker.kind != "vllm":
        return {}
    with httpx.Client() as http:
        samples = promtext.parse(http.get(f"{worker.url}/metrics", timeout=5.0).text)
    return {
        source: promtext.total(samples, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
    }


def _await_ready(bed: Bed, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline and not bed.router.ready(http):
            time.sleep(0.2)


SCENARIOS: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {
    "status500": standin_fault,
    "slow-read": standin_fault,
    "never-read": standin_fault,
    "hang": hang,
    "kill": kill,
    "leave-before-first-byte": leave_before_first_byte,
    "leave-mid-stream": leave_mid_stream,
    "leave-mid-upload": leave_mid_upload,
    "slow-reader": slow_reader,
    "burst": burst,
    "lost-registration": lost_registration,
}
