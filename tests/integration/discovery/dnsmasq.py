"""A dnsmasq on loopback serving records from a hosts file that the test rewrites (re-read on SIGHUP)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DOMAIN = "kvpush.test"


def dnsmasq_binary() -> str | None:
    return shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.path.exists(p)), None
    )


def _free_udp_tcp_port() -> int:
    """A loopback port free for both UDP and TCP right now (dnsmasq listens on both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free loopback port for dnsmasq")


class Dnsmasq:
    """A dnsmasq on 127.0.0.1 answering only for *.kvpush.test from a hosts file the test rewrites.
    SIGHUP makes dnsmasq re-read --addn-hosts files (not --host-record options, which are fixed at start)."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.hosts = folder / "hosts"
        self.log = folder / "dnsmasq.log"
        self.port = _free_udp_tcp_port()
        self.set_records({})
        folder.chmod(0o755)  # dnsmasq may read as another user after it drops privileges
        command = [
            binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts}",
            f"--local=/{DOMAIN}/",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--port={self.port}",
            "--pid-file=",
            "--log-facility=-",
            f"--user={pwd.getpwuid(os.getuid()).pw_name}",
            "--cache-size=0",
        ]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._wait_started()

    def _wait_started(self) -> None:
        deadline = time.monotonic() + 10
        while b"read " not in self.log.read_bytes():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def set_records(self, records: dict[str, list[str]], *, wait: bool = True) -> None:
        """Replaces every record (short name → addresses) atomically and tells dnsmasq to re-read; with `wait`,
        returns once dnsmasq has logged the re-read (not while it is paused)."""
        lines = [f"{address} {name}.{DOMAIN}\n" for name, addresses in records.items() for address in addresses]
        tmp = self.hosts.with_suffix(".new")
        tmp.write_text("".join(lines))
        tmp.chmod(0o644)
        tmp.replace(self.hosts)
        if getattr(self, "process", None) is None:
            return
        reads = self._reads()
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while wait and self._reads() == reads:
            if time.monotonic() > deadline:
                raise RuntimeError("dnsmasq did not re-read its hosts file after SIGHUP")
            time.sleep(0.02)

    def _reads(self) -> int:
        return self.log.read_bytes().count(f"read {self.hosts} ".encode())

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
