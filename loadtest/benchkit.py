"""Shared machinery of the benchmark suites: child processes (sims, routers), probes, one measured point."""

import asyncio
import contextlib
import fcntl
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtest import promtext
from loadtest.arrivals import ArrivalSpec
from loadtest.job import REPO, Job, execute, execute_together
from loadtest.results import RowLabels, append_rows, build_row, git_commit
from loadtest.runner import LoadConfig, RunResult
from loadtest.stats import Summary, paired_ttft
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec
from stack.routers import Router, router_spec

VROUTER_VERSION = "0.1.17"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def sim_proc(
    name: str, role: str, port: int, profile: str, kv_mode: str, log_dir: Path, write_at: str | None = None
) -> ManagedProcess:
    """A simulated engine; `write_at` (writes.WriteAt) is when a push P posts its WRITE (default: completing-step)."""
    argv: tuple[str, ...] = (
        sys.executable,
        "-m",
        "loadtest",
        "sim",
        "--role",
        role,
        "--port",
        str(port),
        "--profile",
        profile,
        "--engine-id",
        name,
        "--kv-mode",
        kv_mode,
        *(("--write-at", write_at) if write_at else ()),
    )
    return ManagedProcess(ProcessSpec(name, argv, _env(), log_dir / f"{name}.log", f"{url(port)}/health", REPO))


def router_proc(
    name: str,
    port: int,
    mode: str,
    prefill: str,
    decode: str,
    log_dir: Path,
    cprofile_to: Path | None = None,
    flags: Sequence[str] = (),
) -> ManagedProcess:
    """Our router. `prefill` is a SPEC: URL or URL,engine_id=..,side_port=.. (see router's contract).

    `cprofile_to`: run it under loadtest.profiled (SIGUSR1 starts cProfile, SIGUSR2 writes that file).
    `flags`: further `kvpush serve` flags (a suite's own router settings).
    """
    runner = ("-m", "loadtest.profiled", str(cprofile_to)) if cprofile_to else ("-m",)
    spec = router_spec(port, mode, [prefill], [decode], "--log-level", "warning", *flags, name=name, runner=runner)
    return Router(spec, log_dir=log_dir)


def vrouter_binary() -> str | None:
    """vllm-router from $VLLM_ROUTER, the repo's .venv-vrouter, or PATH (in that order)."""
    for candidate in (os.environ.get("VLLM_ROUTER"), str(REPO / ".venv-vrouter" / "bin" / "vllm-router")):
        if candidate and Path(candidate).exists():
            return candidate
    return shutil.which("vllm-router")


def vrouter_proc(
    name: str, port: int, prom_port: int, prefill: str, decode: str, log_dir: Path, binary: str
) -> ManagedProcess:
    """vllm-router 0.1.17 in P/D mode with the NIXL connector (the anchors' flags, section 1)."""
    argv = (
        binary,
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--kv-connector",
        "nixl",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--prometheus-port",
        str(prom_port),
        "--log-level",
        "warning",
    )
    return ManagedProcess(ProcessSpec(name, argv, _env(), log_dir / f"{name}.log", f"{url(port)}/health", REPO))


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[promtext.Sample, float]:
    resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return promtext.parse(resp.text)


def kv_sources(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, float]:
    """Prompt tokens the decode engine got per source over a run (vllm:prompt_tokens_by_source_total delta)."""
    name = "vllm:prompt_tokens_by_source_total"
    b, a = promtext.by_label(before, name, "source"), promtext.by_label(after, name, "source")
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(set(a) | set(b))}


def sim_fidelity(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, float]:
    """A simulator's real-vs-modeled step time over a run: mean lag per step (ms) and lag / modeled time."""
    d = {
        k: promtext.total(after, f"kvpush_sim_{k}") - promtext.total(before, f"kvpush_sim_{k}")
        for k in ("steps_total", "modeled_seconds_total", "lag_seconds_total")
    }
    if d["steps_total"] <= 0:
        return {}
    out = {"lag_ms_per_step": 1000 * d["lag_seconds_total"] / d["steps_total"]}
    if d["modeled_seconds_total"] > 0:
        out["lag_frac"] = d["lag_seconds_total"] / d["modeled_seconds_total"]
    return out


def kv_external_frac(sources: Mapping[str, float]) -> float | None:
    total = sum(sources.values())
    return None if total <= 0 else sources.get("external_kv_transfer", 0.0) / total


def group_cpu_seconds(pid: int) -> float:
    """utime + stime of every live process in `pid`'s process group (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid:  # field 5 of stat: pgrp
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def group_peak_rss_mb(pid: int) -> float:
    """Sum of VmHWM (peak resident set) over the group's live processes, in MiB."""
    total_kb = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb / 1024


@dataclass(frozen=True)
class Point:
    """One measured run of a suite: where to send, how much, and how to label the row."""

    labels: RowLabels
    base_url: str
    n: int
    seed: int
    warmup: int = 2
    tokenizer: str = "synthetic"
    tokenizer_url: str | None = None
    router_timings: bool = False
    decode_url: str | None = None  # scrape its /metrics before and after (KV arrived by transfer?)
    prefill_url: str | None = None  # a simulated P: scrape its loop fidelity too
    timeout_s: float = 300.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    legs_of: tuple[str, str] | None = None  # simulated (P, D) URLs: record how the front door sent the legs
    stride: int = 1  # > 1: one arrival per block of `stride` of the label's stream (fronts in turn; ArrivalSpec)
    phase: int = 0
    salt: int = 0  # the prompts' salt (0: from the clock); fronts loaded together need distinct ones


def _name(point: Point) -> str:
    lab = point.labels
    rep = point.extra.get("repeat", lab.extra.get("repeat"))
    name = f"{lab.suite}-{lab.router}-{lab.mode}-{lab.connector}-q{lab.qps}-c{lab.concurrency}"
    name += f"-r{rep}" if rep is not None else ""
    client = point.extra.get("leg_client", lab.extra.get("leg_client"))
    name += f"-{client}" if client is not None else ""  # two kvpush fronts on different leg clients
    server = point.extra.get("server", lab.extra.get("server"))
    name += f"-{server}" if server is not None else ""  # ... or on different HTTP servers
    return name


def _job(point: Point, run_dir: Path, progress: bool) -> Job:
    lab, name = point.labels, _name(point)
    load = LoadConfig(
        base_url=point.base_url,
        model="",
        input_len=lab.input_len,
        output_len=lab.output_len,
        num_requests=point.n,
        arrivals=ArrivalSpec(lab.qps or float("inf"), 1.0, point.seed, point.stride, point.phase),
        concurrency=lab.concurrency,
        warmup=point.warmup,
        timeout_s=point.timeout_s,
        request_id_prefix=f"{lab.suite}-{lab.mode}-{point.seed}",
    )
    return Job(
        load=load,
        tokenizer=point.tokenizer,
        tokenizer_url=point.tokenizer_url,
        salt=point.salt,
        router_timings=point.router_timings,
        out_dir=run_dir / name,
        progress=sys.stderr if progress else None,
        label=name,
    )


def measure(
    point: Point, run_dir: Path, summary_path: Path, progress: bool, cpu_pid: int | None = None
) -> dict[str, Any]:
    """Run one point, append its row to summary_path and return the row (per-request JSONL under run_dir)."""
    before = scrape(point.decode_url) if point.decode_url else None
    p_before = scrape(point.prefill_url) if point.prefill_url else None
    cpu: list[float] = []  # the front's CPU seconds before the load and once it is done
    job = _job(point, run_dir, progress)
    if cpu_pid:
        # read before the router timings are fetched: serving GET /debug/timings is the harness's cost
        job = replace(job, on_loaded=lambda: cpu.append(group_cpu_seconds(cpu_pid)))
        cpu.append(group_cpu_seconds(cpu_pid))
    since = time.monotonic()
    result, summary = asyncio.run(execute(job))
    extra: dict[str, Any] = dict(point.labels.extra) | dict(point.extra)
    if cpu_pid is not None and len(cpu) == 2:
        done = max(summary.n + point.warmup, 1)
        extra["cpu_s_per_1k"] = (cpu[1] - cpu[0]) / done * 1000
        extra["peak_rss_mb"] = group_peak_rss_mb(cpu_pid)
    if p_before is not None and point.prefill_url:
        extra["sim_prefill_fidelity"] = sim_fidelity(p_before, scrape(point.prefill_url))
    if before is not None and point.decode_url:
        extra.update(_decode_extra(before, scrape(point.decode_url)))
    if point.legs_of is not None:
        extra.update(wire_order_or_note(point.legs_of, since))
    row = _row(point, result, summary, extra, run_dir)
    append_rows(summary_path, [row])
    return row


def measure_together(
    points: Sequence[Point], run_dir: Path, summary_path: Path, progress: bool
) -> list[dict[str, Any]]:
    """Load several fronts at the same time, each on its own prompts (give the points distinct salts) and its
    arrivals (distinct seeds, or one seed and stride = the number of fronts, a phase each: the fronts then take
    one arrival stream in turn, so consecutive arrivals meet the same engines); one row per front. Every
    decode's /metrics are read once around the whole run, so a row's KV sources are its decode's, counting the
    requests of every front on it (`kv_sources: "shared"`). Two fronts in turn also get `paired_ttft`."""
    names = [_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ValueError(f"measure_together: fronts need distinct labels, got {names}")
    decodes = sorted({p.decode_url for p in points if p.decode_url})
    before = {d: scrape(d) for d in decodes}
    done = asyncio.run(execute_together([_job(p, run_dir, progress) for p in points]))
    after = {d: scrape(d) for d in decodes}
    in_turn = len(points) == 2 and all(p.stride == 2 for p in points) and points[0].seed == points[1].seed
    rows = []
    for k, (point, (result, summary)) in enumerate(zip(points, done, strict=True)):
        extra: dict[str, Any] = dict(point.labels.extra) | dict(point.extra)
        if point.decode_url:
            extra.update(_decode_extra(before[point.decode_url], after[point.decode_url]))
            extra["kv_sources"] = "shared"
        if in_turn and (paired := paired_ttft(result.records, done[1 - k][0].records)) is not None:
            extra["paired_ttft"] = paired | {"with": points[1 - k].labels.router}
        rows.append(_row(point, result, summary, extra, run_dir))
    append_rows(summary_path, rows)
    return rows


def _decode_extra(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if fid := sim_fidelity(before, after):
        extra["sim_decode_fidelity"] = fid
    sources = kv_sources(before, after)
    extra["decode_prompt_tokens_by_source"] = sources
    extra["kv_external_frac"] = kv_external_frac(sources)
    return extra


def _row(point: Point, result: RunResult, summary: Summary, extra: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    lab, name = point.labels, _name(point)
    extra["load_started_unix"], extra["load_s"] = result.started_unix, result.duration_s
    extra["errors"] = sorted({r.error for r in result.records if r.error})[:5]
    records = run_dir / name / "requests.jsonl"
    extra["records"] = str(records.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(records)
    labels = RowLabels(
        lab.suite, lab.router, lab.mode, lab.connector, lab.qps, lab.concurrency, lab.input_len, lab.output_len, extra
    )
    return build_row(summary, labels, git_commit(REPO))


def legs(base_url: str, timeout_s: float = 10.0) -> list[tuple[str, str, float]]:
    """A simulator's leg log: (handoff key, leg kind, CLOCK_MONOTONIC at arrival) per generation request."""
    resp = httpx.get(base_url.rstrip("/") + "/debug/legs", timeout=timeout_s)
    resp.raise_for_status()
    return [(str(k), str(kind), float(t)) for k, kind, t in resp.json()["legs"]]


def wire_order_or_note(
    legs_of: tuple[str, str], since: float, read: Callable[[str], list[tuple[str, str, float]]] | None = None
) -> dict[str, Any]:
    """{"wire_order": ...} from the simulated (P, D)'s leg logs (`read`: `legs` by default); when either cannot be
    read (a starved simulator past the timeout, a dead one), {"wire_order": None, "wire_order_note": why}, so
    one point's missing leg log does not end the run."""
    read = read or legs
    try:
        return {"wire_order": wire_order(read(legs_of[0]), read(legs_of[1]), since)}
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        note = f"/debug/legs unreadable: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"benchkit: {note}; the row records no wire order", file=sys.stderr)
        return {"wire_order": None, "wire_order_note": note}


def wire_order(
    p_legs: Sequence[tuple[str, str, float]], d_legs: Sequence[tuple[str, str, float]], since: float
) -> dict[str, Any]:
    """How a front door sent the two legs of each request since `since` (monotonic), seen by the workers.

    `d_after_p_ms`: D's leg arrival minus P's leg arrival, per request joined by handoff key (p50/max); a
    concurrent front door sends D's leg well before P answers. `d_kinds`: D's legs by kind ("push" = D was not
    given P's block ids, i.e. it did not wait for P's answer; "pull" = it did).
    """
    p_at = {k: t for k, kind, t in p_legs if t >= since and kind == "prefill"}
    gaps = sorted(1000 * (t - p_at[k]) for k, kind, t in d_legs if t >= since and k in p_at)
    kinds: dict[str, int] = {}
    for _, kind, t in d_legs:
        if t >= since:
            kinds[kind] = kinds.get(kind, 0) + 1
    out: dict[str, Any] = {"joined": len(gaps), "d_kinds": kinds}
    if gaps:
        out["d_after_p_ms_p50"] = gaps[len(gaps) // 2]
        out["d_after_p_ms_max"] = gaps[-1]
    return out


LOCK = Path("/tmp/kvpush-vllm.lock")


def _ancestors() -> set[int]:
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def lock_held_by_ancestor(path: Path = LOCK) -> bool:
    """True when a process above us (e.g. `flock /tmp/kvpush-vllm.lock ...`) holds an flock on `path` (/proc/locks)."""
    try:
        inode = path.stat().st_ino
        table = Path("/proc/locks").read_text()
    except OSError:
        return False
    mine = _ancestors()
    for line in table.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" (a "->" marks a blocked waiter)
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            pid, ino = int(parts[4]), int(parts[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if ino == inode and pid in mine:
            return True
    return False


@contextlib.contextmanager
def vllm_lock(path: Path = LOCK) -> Iterator[None]:
    """The machine's one-vLLM-run-at-a-time lock; a no-op when an ancestor process already holds it."""
    path.touch(exist_ok=True)
    if lock_held_by_ancestor(path):
        yield
        return
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load(base_url: str, client: httpx.Client) -> float:
    """Requests running + waiting on a vLLM engine (waiting includes those waiting for remote KV)."""
    samples = promtext.parse(client.get(base_url.rstrip("/") + "/metrics", timeout=5.0).text)
    return promtext.total(samples, "vllm:num_requests_running") + promtext.total(samples, "vllm:num_requests_waiting")


def concurrency_probe(
    front: str, p_url: str, d_url: str, prompt_tokens: int = 1500, polls: int = 2000
) -> dict[str, Any]:
    """Does `front` send D's leg while P is still prefilling? Seen from the engines, not from the front.

    Two short requests first (vllm-router learns a push prefill's identity from its first answer). Then P's
    prefill time of a long prompt, measured directly on P; then the same length through the front while only
    D's /metrics is polled: `d_seen_ms` is when D first holds the request (running or waiting, which includes
    waiting for remote KV). A sequential front cannot show it before P's prefill is done, so "concurrent" is
    d_seen_ms < 0.75 x P's prefill time (D's own tokenization and the polls take some of it). Prompts start
    with distinct words, so no prefix cache helps.
    """
    out: dict[str, Any] = {}
    with httpx.Client(timeout=120.0) as c:
        model = c.get(front.rstrip("/") + "/v1/models").json()["data"][0]["id"]
        sample = "hello " * 100
        count = c.post(p_url.rstrip("/") + "/tokenize", json={"model": model, "prompt": sample}).json()["count"]
        words = max(int(prompt_tokens * 100 / max(int(count), 1)) - 8, 16)

        def body(tag: str, n: int, max_tokens: int) -> dict[str, Any]:
            return {"model": model, "prompt": f"{tag} " + "hello " * n, "max_tokens": max_tokens}

        for i in range(2):
            c.post(front.rstrip("/") + "/v1/completions", json=body(f"warm{i}-{time.time_ns()}", 16, 2))
        t = time.monotonic()
        r = c.post(p_url.rstrip("/") + "/v1/completions", json=body(f"direct-{time.time_ns()}", words, 1))
        out["p_prefill_ms"] = 1000 * (time.monotonic() - t)
        if r.status_code != 200:
            return out | {"concurrent": False, "error": f"direct prefill: {r.status_code} {r.text[:200]}"}

    def send() -> None:
        with httpx.Client(timeout=120.0) as c:
            r = c.post(front.rstrip("/") + "/v1/completions", json=body(f"probe-{time.time_ns()}", words, 2))
            out["status"] = r.status_code

    worker = threading.Thread(target=send, daemon=True)
    with httpx.Client() as client:
        t0 = time.monotonic()
        worker.start()
        for _ in range(polls):
            if _load(d_url, client) > 0:
                out["d_seen_ms"] = 1000 * (time.monotonic() - t0)
                break
            if not worker.is_alive():
                break
    worker.join(timeout=120.0)
    seen = out.get("d_seen_ms")
    out["concurrent"] = out.get("status") == 200 and seen is not None and seen < 0.75 * out["p_prefill_ms"]
    return out
