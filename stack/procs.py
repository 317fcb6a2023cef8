"""Child processes of the local stack: one process group each, a log file, readiness over HTTP, clean stop.

A `ManagedProcess` starts its command in a new session (so the command and everything it forks share one
process group that nothing else uses), sends stdout and stderr to a log file, waits until an HTTP URL
answers 200 (failing fast with the log tail when the child dies), and stops the whole group: SIGTERM,
a grace period, then SIGKILL. Each child also gets SIGTERM if the thread that started it dies, so a
killed launcher leaves no engine behind. What to do next while waiting is decided by the pure
`readiness()`; the loop around it only does the I/O.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import http.client
import os
import random
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A child did not become ready: it exited, or the deadline passed. Carries the tail of its log."""

    def __init__(self, name: str, reason: str, log_path: Path, tail: Sequence[str]) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.tail = list(tail)
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (log is empty)"
        super().__init__(f"{name} failed to start: {reason}; last lines of {log_path}:\n{lines}")


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What to run: argv, the complete environment, where to log and which URL answers 200 once ready."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    ready_url: str
    cwd: Path | None = None


class Readiness(enum.Enum):
    READY = "ready"
    WAIT = "wait"
    EXITED = "exited"
    TIMED_OUT = "timed out"


def readiness(exit_code: int | None, http_status: int | None, now: float, deadline: float) -> Readiness:
    """Decide one poll of a starting child: exit first (a dead child never counts as ready), then HTTP."""
    if exit_code is not None:
        return Readiness.EXITED
    if http_status == 200:
        return Readiness.READY
    if now >= deadline:
        return Readiness.TIMED_OUT
    return Readiness.WAIT


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """Status of a GET to url, or None when nothing answers (refused, reset, timed out)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or LOOPBACK, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path or "/")
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return status


# Ports are picked below Linux's default ephemeral range (32768-60999), so no outgoing connection (a router's leg,
# a client) is given the port between its pick and the server's bind, as the kernel's own pick for port 0 allows.
PICK_RANGE = (20000, 32768)
_PICKS = 200  # tries before falling back to the kernel's pick


def free_port(
    host: str = LOOPBACK,
    pick: Callable[[int, int], int] | None = None,
    is_free: Callable[[int, str], bool] | None = None,
) -> int:
    """A TCP port that was free on host a moment ago: a random one in PICK_RANGE that binds, else the kernel's."""
    check, choose = is_free or port_is_free, pick or random.SystemRandom().randrange
    for _ in range(_PICKS):
        port = choose(*PICK_RANGE)
        if check(port, host):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        kernels: int = sock.getsockname()[1]
        return kernels


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True when a server could bind host:port now (SO_REUSEADDR, as servers use, so TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def group_members(pgid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid, read from /proc."""
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def tail_lines(path: Path, n: int, max_bytes: int = 65536) -> list[str]:
    """The last n lines of a text file (reads at most max_bytes from its end); [] if it does not exist."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:] if n > 0 else []


def pin_group(pgid: int, core: int, proc_root: Path = Path("/proc"), passes: int = 5) -> None:
    """Pin every thread of every process in group `pgid` to `core`, pass after pass until a pass finds none
    left elsewhere (a thread started during a pass inherits its creator's cores, perhaps not yet pinned)."""
    for _ in range(passes):
        moved = 0
        for pid in group_members(pgid, proc_root):
            try:
                tids = [int(t) for t in os.listdir(proc_root / str(pid) / "task")]
            except OSError:
                continue  # exited while we looked
            for tid in tids:
                try:
                    if os.sched_getaffinity(tid) != {core}:
                        os.sched_setaffinity(tid, {core})
                        moved += 1
                except OSError:
                    continue  # exited while we looked
        if moved == 0:
            return
    raise RuntimeError(f"process group {pgid} kept starting threads off core {core}")


def _die_with_parent() -> None:
    """preexec hook: SIGTERM this child when the thread that forked it goes away (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ManagedProcess:
    """One child process group. Call order: start(), wait_healthy(), ..., stop(); stop() is idempotent.

    Call start() from a thread that outlives the child (normally the main thread): the child is sent
    SIGTERM when the starting thread exits.
    """

    def __init__(
        self,
        spec: ProcessSpec,
        *,
        probe: Callable[[str], int | None] = http_status,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.spec = spec
        self._probe = probe
        self._clock = clock
        self._sleep = sleep
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Launch the child in its own session; the log file is truncated first."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                list(self.spec.argv),
                env=dict(self.spec.env),
                cwd=self.spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # only a prctl call: safe between fork and exec
            )

    def exit_code(self) -> int | None:
        """The child's exit status once it has exited (None while running or before start)."""
        return self._proc.poll() if self._proc else None

    def poll_ready(self, deadline: float) -> Readiness:
        """One readiness check against an absolute deadline on this process's clock."""
        proc = self._require_started()
        code = proc.poll()
        status = None if code is not None else self._probe(self.spec.ready_url)
        return readiness(code, status, self._clock(), deadline)

    def wait_healthy(self, timeout: float, interval: float = 0.5) -> None:
        """Block until ready_url answers 200; raise StartupError if the child exits or timeout passes."""
        deadline = self._clock() + timeout
        while True:
            verdict = self.poll_ready(deadline)
            if verdict is Readiness.READY:
                return
            if verdict is not Readiness.WAIT:
                raise self.startup_error(verdict)
            self._sleep(interval)

    def startup_error(self, verdict: Readiness, lines: int = 40) -> StartupError:
        """The error to raise for a failed start, with the last lines of the log."""
        code = self.exit_code()
        reason = f"exited with status {code}" if verdict is Readiness.EXITED else verdict.value
        return StartupError(self.name, reason, self.log_path, self.log_tail(lines))

    def log_tail(self, n: int = 40) -> list[str]:
        return tail_lines(self.log_path, n)

    def terminate(self) -> None:
        """Send SIGTERM to the whole group without waiting (lets a caller stop many in parallel)."""
        self._signal_group(signal.SIGTERM)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the group, SIGKILL what is left after `grace` seconds, reap; returns the exit status."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        if not self._wait_group_gone(self._clock() + grace):
            self._signal_group(signal.SIGKILL)
            self._wait_group_gone(self._clock() + 5.0)
        return self._proc.wait(timeout=5.0)

    def group_alive(self) -> list[int]:
        """Members of this child's process group still running (empty after a clean stop)."""
        return group_members(self._proc.pid) if self._proc else []

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # the whole group has already exited
            os.killpg(self._proc.pid, sig)

    def _wait_group_gone(self, deadline: float) -> bool:
        proc = self._require_started()
        while True:
            proc.poll()  # reap the leader so it stops counting as a member
            if not self.group_alive():
                return True
            if self._clock() >= deadline:
                return False
            self._sleep(0.1)

    def _require_started(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self._proc
