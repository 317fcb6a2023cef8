"""`kvpush stack` supervision end to end on stand-in children: ready line, signals, failures, no orphans."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stack.engines import REPO_ROOT
from tests.integration.support import CACHE, INTEGRATION, alive

pytestmark = INTEGRATION
DRIVER = Path(__file__).with_name("local_driver.py")
NAMES = ("prefill", "decode", "router")


def launch(log_dir: Path, *flags: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, str(DRIVER), str(log_dir), *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test, not the terminal, decides which signal the driver gets
    )


def child_pids(log_dir: Path) -> list[int]:
    pids = []
    for name in NAMES:
        log = log_dir / f"{name}.log"
        if log.exists():
            pids += [int(p) for p in re.findall(r"(?:pid|grandchild)=(\d+)", log.read_text())]
    return pids


def wait_for_ready_line(driver: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """The driver's first stdout line ("" if it exited first); fails the test rather than hang."""
    assert driver.stdout is not None
    ready, _, _ = select.select([driver.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"no ready line and no exit within {timeout:g} s")
    return driver.stdout.readline()  # the driver prints whole lines only


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_ready_line_then_a_stop_signal_stops_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    driver = launch(tmp_path)
    try:
        assert wait_for_ready_line(driver) == "kvpush stack ready: stand-ins up\n"
        pids = child_pids(tmp_path)
        assert len(pids) == 5  # two engines with a grandchild each, and the router
        assert all(alive(pid) for pid in pids)
        driver.send_signal(sig)
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 0, err
    assert f"stopped ({sig.name})" in err
    assert not [pid for pid in pids if alive(pid)]


def test_an_engine_that_dies_later_is_reported_and_everything_stops(tmp_path: Path) -> None:
    driver = launch(tmp_path, "--engine-flags", "--grandchild --die-after 1")
    try:
        assert wait_for_ready_line(driver).startswith("kvpush stack ready")
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 1
    assert re.search(r"(prefill|decode) exited with status 7", err)
    assert "standin: dying now" in err
    assert not [pid for pid in child_pids(tmp_path) if alive(pid)]


def test_a_router_that_fails_to_start_is_reported_with_its_log(tmp_path: Path) -> None:
    driver = launch(tmp_path, "--router-flags", "--fail 2")
    try:
        out, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 1
    assert out == ""  # no ready line
    assert "router failed to start: exited with status 2" in err
    assert "standin: failing on purpose at start-up" in err
    assert not [pid for pid in child_pids(tmp_path) if alive(pid)]


def test_the_real_entry_point_refuses_ports_already_in_use(tmp_path: Path) -> None:
    """`kvpush stack` checks its ports before starting anything (the model is built first: needs torch)."""
    pytest.importorskip("transformers", reason="the entry point builds the tiny model first")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "stack.local",
                "--port",
                str(port),
                "--cache-dir",
                str(CACHE),
                "--prefill-port",
                "0",
                "--decode-port",
                "0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 1
    assert f"ports already in use on 127.0.0.1: [{port}" in done.stderr  # the router port comes first
    assert done.stdout == ""
