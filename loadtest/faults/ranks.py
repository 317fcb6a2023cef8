"""Rank faults (issue 42 item 1) on bed `vllm-tp`: p0 is a TP=2 prefill (two worker processes, each with its own
NIXL agent writing its KV head into decode's blocks), p1 a plain prefill, one TP=1 decode.

`tp_rank_kill`: SIGKILL on p0's rank-1 worker process while p0's legs are in flight (their WRITEs from both ranks
under way): clients must be served (retried on p1) or fail clearly, the router must hold p0 out and serve new
requests on p1, and decode must let go of every leg p0 fed (the runner's observe() waits for it)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from loadtest.faults import client
from loadtest.faults.bed import Bed, Worker
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome, _clients, _outcome, _wait_running
from loadtest.faults.sustained import counters
from loadtest.faults.underload import LOAD_FRACTION, Load, capacity, judge_load

DECODE_COUNTERS = {
    "failed transfers": "vllm:kvpush_failed_transfers_total",
    "quarantined": "vllm:kvpush_quarantined_total",
    "cancelled": "vllm:kvpush_cancelled_total",
}
RANK_TITLE = "Worker_TP1"  # vLLM's process title of TP rank 1 (VLLM::Worker_TP1)
DECODE_LOAD_S = 30.0  # the decode-rank row's steady load, of which DECODE_LEAD_S before the kill
DECODE_LEAD_S = 8.0


def group_members(pgid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """Every process in process group `pgid`, with its command line (spaces for NULs)."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return found


def rank_pid(members: dict[int, str], title: str = RANK_TITLE) -> int | None:
    """Pure: the one process whose command line carries `title` (None when none or several do)."""
    hits = [pid for pid, cmdline in members.items() if title in cmdline]
    return hits[0] if len(hits) == 1 else None


def _router_holds_out(bed: Bed, victim: Worker, timeout: float = 30.0) -> bool:
    """Until the router's /ready says the victim is not healthy (False if it still does at the timeout)."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            workers = http.get(f"{bed.router.url}/ready", timeout=5.0).json().get("workers", [])
            if any(w.get("url") == victim.url and w.get("healthy") is False for w in workers):
                return True
            time.sleep(0.2)
    return False


def _engine_exit(victim: Worker, timeout: float = 60.0) -> float | None:
    """Seconds until the victim's API server exits after its rank died (None: still up at the timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if victim.handle.exit_code() is not None:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def tp_rank_kill(bed: Bed, row: FaultRow) -> FaultOutcome:
    victim = bed.prefills[0]
    rank = rank_pid(group_members(victim.pid))
    if rank is None:
        return FaultOutcome(f"no single {RANK_TITLE} process under {victim.name}", False, float("inf"))
    decode = bed.decodes[0]
    before = counters(decode, DECODE_COUNTERS)
    futures = _clients(bed.router.url, 4, lambda: client.body(max_tokens=16, words=120))
    _wait_running(victim, futures)
    os.kill(rank, signal.SIGKILL)
    t_fault = time.monotonic()
    futures += _clients(bed.router.url, 3, lambda: client.body(max_tokens=16))
    results = [f.result() for f in futures]
    held_out = _router_holds_out(bed, victim)
    exited = _engine_exit(victim)
    after = [client.request(bed.router.url, client.body(max_tokens=16)) for _ in range(3)]
    if exited is not None:
        victim.killed = True  # observed as dead from now on
    after_counts = counters(decode, DECODE_COUNTERS)
    outcome = _outcome(results, t_fault)
    served_after = sum(1 for r in after if r.status == 200 and r.complete)
    outcome.acceptable = outcome.acceptable and held_out and served_after == len(after)
    outcome.note = (
        f"router holds {victim.name} out: {'yes' if held_out else 'NO'}; its API server "
        + (f"exited {exited:.1f} s after the rank" if exited is not None else "still up 60 s after the rank")
        + f"; {served_after} of {len(after)} requests after the fault served (on p1); on decode: "
        + ", ".join(f"{k} +{after_counts[k] - before[k]:g}" for k in DECODE_COUNTERS)
    )
    return outcome


def tp_rank_hang(bed: Bed, row: FaultRow) -> FaultOutcome:
    """SIGSTOP on p0's rank 1 with legs in flight: p0's API process still answers its health probe, so only the
    leg deadlines (this bed's prefill deadline: bed.TP_SHAPE) and passive health can take p0 out. The rank is
    resumed once the clients and three later requests are done."""
    victim = bed.prefills[0]
    rank = rank_pid(group_members(victim.pid))
    if rank is None:
        return FaultOutcome(f"no single {RANK_TITLE} process under {victim.name}", False, float("inf"))
    futures = _clients(bed.router.url, 4, lambda: client.body(max_tokens=16, words=120))
    _wait_running(victim, futures)
    os.kill(rank, signal.SIGSTOP)
    t_fault = time.monotonic()
    try:
        futures += _clients(bed.router.url, 3, lambda: client.body(max_tokens=16))
        results = [f.result() for f in futures]
        held_out = _router_holds_out(bed, victim, timeout=1.0)
        t_after = time.monotonic()
        after = [client.request(bed.router.url, client.body(max_tokens=16)) for _ in range(3)]
        after_s = time.monotonic() - t_after
    finally:
        os.kill(rank, signal.SIGCONT)
    outcome = _outcome(results, t_fault)
    served_after = sum(1 for r in after if r.status == 200 and r.complete)
    outcome.acceptable = outcome.acceptable and served_after == len(after)
    outcome.note = (
        f"router held {victim.name} out when its clients were done: {'yes' if held_out else 'no'}; "
        f"{served_after} of {len(after)} later requests served in {after_s:.1f} s; the rank resumed after"
    )
    return outcome


def decode_tp_rank_kill(bed: Bed, row: FaultRow) -> FaultOutcome:
    """Bed `vllm-dtp` (the only decode runs TP=2): SIGKILL on decode's rank-1 worker once decode holds requests
    (registered, its blocks allocated, the prefills writing each rank its head), under a steady load at 70 % of
    the bed's capacity. No decode remains, so every client must be served or fail clearly, the router must hold
    decode out, and the prefills must let go of every leg (the runner's observe() waits for it)."""
    victim = bed.decodes[0]
    rank = rank_pid(group_members(victim.pid))
    if rank is None:
        return FaultOutcome(f"no single {RANK_TITLE} process under {victim.name}", False, float("inf"))
    rate = LOAD_FRACTION * capacity(bed.router.url)
    load = Load(bed.router.url, rate, DECODE_LOAD_S)
    load.start()
    time.sleep(DECODE_LEAD_S)
    futures = _clients(bed.router.url, 4, lambda: client.body(max_tokens=64, words=120))
    _wait_running(victim, futures)
    os.kill(rank, signal.SIGKILL)
    t_fault = time.monotonic()
    results = [f.result() for f in futures]
    loaded = load.results()
    _, _, note = judge_load(loaded, t_fault, 0.0)
    held_out = _router_holds_out(bed, victim)
    exited = _engine_exit(victim)
    if exited is not None:
        victim.killed = True
    outcome = _outcome(results, t_fault)
    outcome.acceptable = outcome.acceptable and held_out and all(r.acceptable for _, r in loaded)
    outcome.note = (
        f"load {rate:.2f} req/s ({LOAD_FRACTION:.0%} of capacity) for {DECODE_LOAD_S:g} s; {note} (no decode "
        f"remains: each must be served or fail clearly); router holds {victim.name} out: "
        f"{'yes' if held_out else 'NO'}; its API server "
        + (f"exited {exited:.1f} s after the rank" if exited is not None else "still up 60 s after the rank")
    )
    return outcome


RANKS: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {
    "tp-rank-kill": tp_rank_kill,
    "tp-rank-hang": tp_rank_hang,
    "decode-tp-rank-kill": decode_tp_rank_kill,
}
