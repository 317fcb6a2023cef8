"""Anonymous network namespaces owned by holder processes, so that nothing outlives the harness.

A `Holder` is `unshare --net -- cat` reading a pipe that only the harness holds open: when the harness exits or
is killed (even with SIGKILL) the pipe reaches EOF and `cat` exits; PR_SET_PDEATHSIG (SIGKILL) is the second
line. The kernel frees an anonymous namespace with its last process, and with it every interface in it (a veth
pair goes with either end), its addresses and qdiscs. No `ip netns add`: its bind mounts under /run/netns
would outlive a crashed harness. Commands run inside with `nsenter --net=/proc/PID/ns/net`.

Start holders from the thread that stays alive as long as the link (normally the main thread): PDEATHSIG fires
when the starting thread exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Holder", "NetnsError", "run"]

_PR_SET_PDEATHSIG = 1
COMMAND_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """A namespace could not be made or a command in one failed; carries the command's own message."""


def _die_with_parent() -> None:
    """preexec hook: SIGKILL this holder when the thread that forked it goes away (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command (ip, tc, nsenter ...) and return its stdout; NetnsError with its stderr if it fails."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{shlex.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{shlex.join(argv)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


class Holder:
    """One anonymous network namespace, alive while this handle's process is (`close()` or the harness's end)."""

    def __init__(self, label: str, *, ready_timeout: float = 10.0) -> None:
        self.label = label
        self._proc = subprocess.Popen(
            ["unshare", "--net", "--", "cat"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # no Ctrl-C from the terminal: it ends with its owner, not before
            preexec_fn=_die_with_parent,  # only a prctl call: safe between fork and exec
        )
        self._wait_entered(ready_timeout)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def netns(self) -> str:
        """The namespace's path for `nsenter --net=` and `ip link set ... netns`."""
        return f"/proc/{self.pid}/ns/net"

    def nsenter(self) -> tuple[str, ...]:
        """The argv prefix that runs a command inside this namespace (nsenter execs: same PID, same group)."""
        return ("nsenter", f"--net={self.netns}", "--")

    def run(self, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run one command inside the namespace."""
        return run([*self.nsenter(), *argv], timeout=timeout)

    def script(self, commands: Sequence[Sequence[str]]) -> None:
        """Run several commands inside the namespace in one process, stopping at the first that fails."""
        if commands:
            self.run(["sh", "-ec", "\n".join(shlex.join(c) for c in commands)])

    def read_proc(self, name: str) -> str:
        """A file of /proc/PID/net of this namespace (e.g. `dev`), read without entering it."""
        return Path(f"/proc/{self.pid}/net/{name}").read_text()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """End the holder (EOF on its pipe, then SIGKILL if it lingers) and reap it; idempotent."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=timeout)
        if self._proc.stderr is not None:
            self._proc.stderr.close()

    def _wait_entered(self, timeout: float) -> None:
        """Wait until the holder is in its own namespace (Popen returns once `unshare` runs, not `cat`)."""
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                err = self._proc.stderr.read().decode(errors="replace").strip() if self._proc.stderr else ""
                raise NetnsError(f"unshare --net failed for {self.label}: {err or f'exit status {code}'}")
            with contextlib.suppress(OSError):
                if os.readlink(self.netns) != own:
                    return
            if time.monotonic() > deadline:
                self.close()
                raise NetnsError(f"the namespace of {self.label} did not appear within {timeout:g} s")
            time.sleep(0.005)
