"""The test side of the hostile stand-in workers (loadtest/faults/hostile_workers.py, run as a command): start
them and a router in front of them, stop them all after each test, and read what the processes hold (memory,
CPU, sockets, error log lines)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from stack.engines import prefill_arg
from stack.procs import ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, router_spec
from tests.integration.support import LOGS, REPO


@dataclass
class Proc:
    """A started child (stand-in or router) and its base URL."""

    handle: ManagedProcess
    url: str
    port: int

    @property
    def pid(self) -> int:
        pid = self.handle.pid
        assert pid is not None
        return int(pid)

    def stats(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.url}/stats", timeout=5).json())

    def hang(self) -> None:
        """SIGSTOP the whole process group: a hang, not a crash."""
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.handle.pid is None or self.handle.exit_code() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self.resume()
        self.handle.stop(5.0)


STARTED: list[Proc] = []  # every child this test process started; stop_all() ends those still running


def stop_all() -> None:
    """Stops every child started here (the autouse fixture of the test modules calls it after each test)."""
    while STARTED:
        STARTED.pop().stop()


def start_process(name: str, argv: list[str], port: int, ready: str = "/health") -> Proc:
    handle = ManagedProcess(
        ProcessSpec(
            name=name,
            argv=tuple(argv),
            env=dict(os.environ),
            log_path=LOGS / f"{name}.log",
            ready_url=f"http://127.0.0.1:{port}{ready}",
            cwd=REPO,
        )
    )
    return _started(Proc(handle, f"http://127.0.0.1:{port}", port))


def _started(proc: Proc) -> Proc:
    """Start a child, remember it for stop_all(), and wait until it answers its ready URL."""
    STARTED.append(proc)
    proc.handle.start()
    proc.handle.wait_healthy(30.0)
    return proc


def hostile(name: str, behaviour: str = "ok", /, **flags: object) -> Proc:
    """One stand-in worker process; flags are this module's options (`kv_dir=...` → `--kv-dir ...`)."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.faults.hostile_workers", "--port", str(port)]
    argv += ["--behaviour", behaviour, "--engine-id", name]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return start_process(f"hostile-{name}-{port}", argv, port)


def router_process(
    prefills: list[Proc], decodes: list[Proc], config: dict[str, Any], *flags: str, ready: str = "/ready"
) -> Proc:
    """A real router on a free port, settings from a YAML file (`limits:` and `timeouts:` blocks work there),
    launched through stack.routers (the one router launcher)."""
    port = free_port()
    settings = {
        "prefill": [prefill_arg(p.url, p.url.rsplit(":", 1)[1], 5600) for p in prefills],
        "decode": [d.url for d in decodes],
        "health_interval": 0.3,
        **config,
    }
    path = LOGS / f"router-hostile-{port}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(settings))
    spec = router_spec(port, None, [], [], *flags, name=f"router-hostile-{port}", config=path, ready_path=ready)
    handle = Router(spec, log_dir=LOGS)
    return _started(Proc(handle, handle.url, handle.port))


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (work done, not wall time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sockets_to(pid: int, port: int) -> int:
    """TCP sockets the process holds open to `port` on loopback (any state but LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                remote_port = int(cols[2].rsplit(":", 1)[1], 16)
                if remote_port == port and cols[9] in inodes and cols[3] != "0A":
                    count += 1
    return count


def error_lines(log: Path) -> list[str]:
    """Log lines at ERROR or above, or carrying a traceback."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            if "Traceback" in line or " ERROR " in line:
                out.append(line)
            continue
        if isinstance(record, dict) and (record.get("level") in ("error", "critical") or "exc" in record):
            out.append(line)
    return out
