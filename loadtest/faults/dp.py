"""Data-parallel rank faults (issue 42 item 1) on bed `vllm-dp`: p0 is a DP=2 prefill (one HTTP server, two engine
cores `EngineCore_DP0` and `EngineCore_DP1`, each its own NIXL engine `<id>_dp<r>`; the router pins every prefill
leg to a rank), p1 a plain prefill, one decode. Each row runs under a steady load of short completions at 70 % of
the bed's measured capacity (underload.py) and records what those other clients got.

`dp_rank_hang`: SIGSTOP on EngineCore_DP1 while p0's legs are in flight. p0's API server still answers /health;
the router must hold rank 1 out (its legs wait without an answer: health.stalled) and serve new requests on rank 0
or p1. `dp_rank_kill`: SIGKILL on EngineCore_DP1; vLLM takes the server down when an engine core dies, so the
router must hold p0 out and serve on p1."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import httpx

from loadtest.faults import client
from loadtest.faults.bed import Bed, Worker
from loadtest.faults.ranks import _engine_exit, group_members, rank_pid
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome, _clients, _wait_running
from loadtest.faults.underload import LOAD_FRACTION, MIN_SUCCESS, Load, capacity, judge_load

RANK_TITLE = "EngineCore_DP1"  # vLLM's process title of data-parallel engine core 1
LOAD_S = 40.0  # the steady load's length, of which LEAD_S before the fault
LEAD_S = 8.0
SETTLE_S = 8.0  # the router's stall budget for these prompts (5 s + 1 ms a token) and a probe round


def rank_usable(snapshot: list[dict[str, object]], url: str, rank: int) -> bool | None:
    """Pure: whether the router's /ready snapshot says `rank` of the worker at `url` is usable (None: not listed)."""
    for worker in snapshot:
        if worker.get("url") != url:
            continue
        if worker.get("healthy") is False:
            return False
        ranks = worker.get("ranks")
        if isinstance(ranks, list):
            for view in ranks:
                if isinstance(view, dict) and view.get("rank") == rank:
                    return bool(view.get("usable"))
    return None


class Watch:
    """Polls the router's /ready on a thread: the first time, after `start`, it shows the victim's rank (or the
    whole worker) out of rotation."""

    def __init__(self, bed: Bed, victim: Worker, rank: int) -> None:
        self.first_out: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bed, victim, rank), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(10.0)
        return self.first_out

    def _run(self, bed: Bed, victim: Worker, rank: int) -> None:
        with httpx.Client() as http:
            while not self._stop.is_set() and self.first_out is None:
                try:
                    workers = http.get(f"{bed.router.url}/ready", timeout=5.0).json().get("workers", [])
                except (httpx.HTTPError, ValueError):
                    workers = []
                if rank_usable(workers, victim.url, rank) is False:
                    self.first_out = time.monotonic()
                time.sleep(0.2)


def caught(
    victims: list[client.Result], loaded: list[tuple[float, client.Result]], t_fault: float, held: float | None
) -> FaultOutcome:
    """Pure: the row's outcome over every request the fault could catch: the victims, and the load's requests
    that started before the router held the rank out (all of them if it never did). The time is the last of
    their outcomes after the fault."""
    exposed = [*victims, *(r for t, r in loaded if held is None or t <= held)]
    last = max((r.t_end for r in exposed), default=t_fault)
    summary = f"{client.summary(victims)}; load: {client.summary([r for _, r in loaded])}"
    return FaultOutcome(summary, all(r.acceptable for r in exposed), max(0.0, last - t_fault))


def _fault(bed: Bed, sig: signal.Signals) -> tuple[FaultOutcome, Worker, int] | FaultOutcome:
    victim = bed.prefills[0]
    rank = rank_pid(group_members(victim.pid), RANK_TITLE)
    if rank is None:
        return FaultOutcome(f"no single {RANK_TITLE} process under {victim.name}", False, float("inf"))
    rate = LOAD_FRACTION * capacity(bed.router.url)
    load = Load(bed.router.url, rate, LOAD_S)
    watch = Watch(bed, victim, 1)
    load.start()
    time.sleep(LEAD_S)
    futures = _clients(bed.router.url, 4, lambda: client.body(max_tokens=16, words=120))
    _wait_running(victim, futures)
    watch.start()
    os.kill(rank, sig)
    t_fault = time.monotonic()
    try:
        results = [f.result() for f in futures]
        loaded = load.results()
        _every, later, note = judge_load(loaded, t_fault, SETTLE_S)
        first_out = watch.stop()
        after = [client.request(bed.router.url, client.body(max_tokens=16)) for _ in range(3)]
    finally:
        if sig is signal.SIGSTOP:
            os.kill(rank, signal.SIGCONT)
    outcome = caught(results, loaded, t_fault, first_out)
    served_after = sum(1 for r in after if r.status == 200 and r.complete)
    held = f"{first_out - t_fault:.1f} s after the fault" if first_out is not None else "NO"
    outcome.acceptable = (
        outcome.acceptable and first_out is not None and served_after == len(after) and later >= MIN_SUCCESS
    )
    outcome.note = (
        f"load {rate:.2f} req/s ({LOAD_FRACTION:.0%} of the bed's measured capacity) for {LOAD_S:g} s; {note}; "
        f"router held rank 1 of {victim.name} (or the server) out: {held}; "
        f"{served_after} of {len(after)} requests after the load served"
    )
    return outcome, victim, rank


def dp_rank_hang(bed: Bed, row: FaultRow) -> FaultOutcome:
    done = _fault(bed, signal.SIGSTOP)
    return done if isinstance(done, FaultOutcome) else done[0]


def dp_rank_kill(bed: Bed, row: FaultRow) -> FaultOutcome:
    done = _fault(bed, signal.SIGKILL)
    if isinstance(done, FaultOutcome):
        return done
    outcome, victim, _ = done
    exited = _engine_exit(victim)
    if exited is not None:
        victim.killed = True  # observed as dead from now on
    outcome.note += "; its API server " + ("exited" if exited is not None else "still up 60 s after the rank died")
    return outcome


DP: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {"dp-rank-hang": dp_rank_hang, "dp-rank-kill": dp_rank_kill}
