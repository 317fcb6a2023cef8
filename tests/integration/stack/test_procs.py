"""stack.procs and stack.engines.Fleet on real child processes (stand-in HTTP servers on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest

from stack.engines import EngineSpec, Fleet
from stack.procs import ManagedProcess, ProcessSpec, StartupError, free_port, group_members, port_is_free
from tests.integration.support import INTEGRATION, alive

pytestmark = INTEGRATION
STANDIN = Path(__file__).with_name("standin.py")


def standin(tmp_path: Path, name: str, *flags: str) -> ManagedProcess:
    port = free_port()
    return ManagedProcess(
        ProcessSpec(
            name=name,
            argv=(sys.executable, str(STANDIN), str(port), *flags),
            env=dict(os.environ),
            log_path=tmp_path / f"{name}.log",
            ready_url=f"http://127.0.0.1:{port}/health",
        )
    )


def pids_in_log(proc: ManagedProcess) -> list[int]:
    return [int(m) for m in re.findall(r"(?:pid|grandchild)=(\d+)", proc.log_path.read_text())]


def test_start_ready_stop_leaves_no_process_of_the_group(tmp_path: Path) -> None:
    proc = standin(tmp_path, "server", "--grandchild")
    proc.start()
    try:
        proc.wait_healthy(30.0)
        pids = pids_in_log(proc)
        assert len(pids) == 2
        assert sorted(group_members(proc.pid or -1)) == sorted(pids)
    finally:
        code = proc.stop(grace=10.0)
    assert code == -15
    assert proc.group_alive() == []
    assert not any(alive(pid) for pid in pids)


def test_a_child_that_exits_at_start_raises_with_its_log_tail(tmp_path: Path) -> None:
    proc = standin(tmp_path, "broken", "--fail", "3")
    proc.start()
    try:
        with pytest.raises(StartupError) as info:
            proc.wait_healthy(120.0)
    finally:
        proc.stop(grace=5.0)
    assert info.value.reason == "exited with status 3"
    assert "standin: failing on purpose at start-up" in info.value.tail
    assert "failing on purpose" in str(info.value)


def test_a_child_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    proc = standin(tmp_path, "slow", "--never-ready")
    proc.start()
    try:
        with pytest.raises(StartupError, match="timed out"):
            proc.wait_healthy(1.0)
    finally:
        proc.stop(grace=5.0)
    assert proc.group_alive() == []


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = standin(tmp_path, "stubborn", "--ignore-term", "--grandchild")
    proc.start()
    proc.wait_healthy(30.0)
    pids = pids_in_log(proc)
    assert proc.stop(grace=1.0) == -9
    assert proc.group_alive() == []
    assert not any(alive(pid) for pid in pids)


def test_stop_is_idempotent_and_safe_before_start(tmp_path: Path) -> None:
    proc = standin(tmp_path, "twice")
    assert proc.stop() is None
    proc.start()
    proc.wait_healthy(30.0)
    assert proc.stop(grace=5.0) == proc.stop(grace=5.0) == -15


def test_fleet_reports_the_member_that_died_and_stops_the_rest(tmp_path: Path) -> None:
    with pytest.raises(StartupError) as info, Fleet(tmp_path) as fleet:
        good = fleet.start(standin(tmp_path, "good", "--grandchild"))
        fleet.start(standin(tmp_path, "bad", "--fail", "4"))
        fleet.wait_all_healthy(120.0)
    assert info.value.name == "bad"
    assert good.group_alive() == []
    assert all(member.exit_code() is not None for member in fleet.members)


def test_fleet_rejects_duplicate_names(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        fleet.start(standin(tmp_path, "prefill"))
        with pytest.raises(ValueError, match="unique"):
            fleet.start_all([_spec_named("prefill")])


def _spec_named(name: str) -> EngineSpec:
    return EngineSpec(name=name, role="single", model=Path("/nonexistent"))


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_port_is_free_sees_a_listener() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)
