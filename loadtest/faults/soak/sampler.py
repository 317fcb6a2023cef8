"""What the soak samples once a minute from the live stack: each process group's RSS and open descriptors (the
router's, every engine's: an engine is its API process plus its engine core and workers), the router's requests
in flight, queued and legs in flight, and each engine's running + waiting requests and KV usage; and, at the
start and the end, the connector's WRITE shape from each prefill's /metrics (descriptors per WRITE, bytes per
descriptor, and blocks per run of consecutive blocks: issue 44's run length after churn)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest import promtext
from loadtest.faults.bed import Bed, Worker
from loadtest.faults.ranks import group_members

PROC = Path("/proc")
DESCRIPTORS = "vllm:kvpush_num_descriptors"  # histogram: descriptors per WRITE
BYTES = "vllm:kvpush_bytes_transferred"  # histogram: bytes per WRITE
RUNS = "vllm:kvpush_run_blocks_"  # histograms: blocks per run of consecutive blocks (prefill, decode, both sides)


@dataclass(frozen=True)
class GroupUse:
    rss_mib: float
    fds: int


def group_use(pgid: int, proc: Path = PROC) -> GroupUse:
    """Summed RSS and open descriptors of every process in group `pgid` (processes that vanish are skipped)."""
    rss_kib, fds = 0, 0
    for pid in group_members(pgid, proc):
        try:
            status = (proc / str(pid) / "status").read_text()
            fds += len(os.listdir(proc / str(pid) / "fd"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        rss_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return GroupUse(rss_kib / 1024, fds)


@dataclass
class Sample:
    t: float  # seconds since the soak's traffic began
    values: dict[str, float] = field(default_factory=dict)  # series name -> value


def series_kind(name: str) -> str:
    """The judge's kind of a series from its name ("router rss_mib" -> "rss_mib")."""
    return name.rsplit(" ", 1)[1]


def take(bed: Bed, t: float, http: httpx.Client) -> Sample:
    sample = Sample(t)
    pid = bed.router.handle.pid
    if pid is not None:
        use = group_use(pid)
        sample.values.update({"router rss_mib": use.rss_mib, "router fds": float(use.fds)})
    sample.values["router in_flight"] = bed.router.gauges(http)["in_flight"]
    for w in bed.workers:
        use = group_use(w.pid)
        state = w.state(http)
        sample.values.update({f"{w.name} rss_mib": use.rss_mib, f"{w.name} fds": float(use.fds)})
        sample.values[f"{w.name} kv_usage"] = state.kv_usage or 0.0
    return sample


def write_shape(workers: Sequence[Worker], http: httpx.Client) -> dict[str, float]:
    """Summed over the prefills: WRITEs, descriptors and bytes posted, and for each block-count histogram the
    connector exports (vllm:kvpush_run_blocks_{prefill,decode,both}: one observation per run of consecutive
    blocks) its sum and count."""
    out: dict[str, float] = {}
    for w in workers:
        try:
            samples = promtext.parse(http.get(f"{w.url}/metrics", timeout=5.0).text)
        except httpx.HTTPError:
            continue
        add(out, "writes", promtext.total(samples, f"{DESCRIPTORS}_count"))
        add(out, "descriptors", promtext.total(samples, f"{DESCRIPTORS}_sum"))
        add(out, "bytes", promtext.total(samples, f"{BYTES}_sum"))
        for name in {n.removesuffix("_sum") for n, _ in samples if n.startswith(RUNS) and n.endswith("_sum")}:
            add(out, f"{name} sum", promtext.total(samples, f"{name}_sum"))
            add(out, f"{name} count", promtext.total(samples, f"{name}_count"))
    return out


def add(into: dict[str, float], key: str, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def shape_between(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Pure: the WRITEs between two readings of `write_shape`, as means: descriptors per WRITE, bytes per
    descriptor, and for each block histogram its mean (blocks per run)."""
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    writes, descriptors = moved.get("writes", 0.0), moved.get("descriptors", 0.0)
    out = {"writes": writes}
    if writes:
        out["descriptors per WRITE"] = descriptors / writes
    if descriptors:
        out["bytes per descriptor"] = moved.get("bytes", 0.0) / descriptors
    for key, total in moved.items():
        if key.endswith(" sum") and (count := moved.get(key.removesuffix(" sum") + " count", 0.0)):
            out[f"{key.removesuffix(' sum')} mean"] = total / count
    return out


def wait_quiet(bed: Bed, timeout: float, http: httpx.Client) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """Waits up to `timeout` s for the router and every engine to hold nothing; returns what they hold then."""
    deadline = time.monotonic() + timeout
    while True:
        router = bed.router.gauges(http)
        engines = {}
        for w in bed.workers:
            s = w.state(http)
            engines[w.name] = (s.running or 0.0, s.kv_usage or 0.0)
        quiet = not any(router.values()) and not any(r or kv for r, kv in engines.values())
        if quiet or time.monotonic() > deadline:
            return router, engines
        time.sleep(0.5)
