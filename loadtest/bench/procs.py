"""Processes the suites start and account for: simulated engines, routers, vllm-router; their CPU and RSS; the
machine's one-vLLM-run-at-a-time lock."""

import contextlib
import fcntl
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from loadtest.job import REPO
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

    `cprofile_to`: run it under loadtest.bench.profiled (SIGUSR1 starts cProfile, SIGUSR2 writes that file).
    `flags`: further `kvpush serve` flags (a suite's own router settings).
    """
    runner = ("-m", "loadtest.bench.profiled", str(cprofile_to)) if cprofile_to else ("-m",)
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


def loop_thread_cpu_ns(pid: int) -> int:
    """CPU time (ns, /proc/<pid>/task/<pid>/schedstat) of `pid`'s main thread: a router's event loop, where its
    requests are served (0 when there is no such process)."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def side_threads_cpu_ns(pid: int) -> int:
    """CPU time (ns, /proc/<pid>/task/*/schedstat) of `pid`'s live threads other than its main one: for a traced
    router, the span export thread and gRPC's, none of which serves requests. Threads that ended are not counted."""
    total = 0
    try:
        tids = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
    except OSError:
        return 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
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
