"""stack.procs decisions and file reading, without starting processes or opening sockets."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

from stack.procs import (
    PICK_RANGE,
    Readiness,
    StartupError,
    free_port,
    group_members,
    pin_group,
    readiness,
    tail_lines,
)


class TestReadiness:
    @pytest.mark.parametrize(
        ("exit_code", "status", "now", "expected"),
        [
            (None, 200, 0.0, Readiness.READY),
            (None, None, 0.0, Readiness.WAIT),
            (None, 503, 0.0, Readiness.WAIT),
            (None, 503, 10.0, Readiness.TIMED_OUT),
            (None, None, 11.0, Readiness.TIMED_OUT),
            (0, None, 0.0, Readiness.EXITED),
            (1, None, 99.0, Readiness.EXITED),
        ],
    )
    def test_verdicts(self, exit_code: int | None, status: int | None, now: float, expected: Readiness) -> None:
        assert readiness(exit_code, status, now, deadline=10.0) is expected

    def test_a_dead_child_is_never_ready_even_if_something_answers_on_its_port(self) -> None:
        assert readiness(1, 200, 0.0, 10.0) is Readiness.EXITED

    def test_ready_wins_over_a_passed_deadline(self) -> None:
        assert readiness(None, 200, 11.0, 10.0) is Readiness.READY


class TestTail:
    def test_last_lines(self, tmp_path: Path) -> None:
        log = tmp_path / "x.log"
        log.write_text("".join(f"line {i}\n" for i in range(100)))
        assert tail_lines(log, 3) == ["line 97", "line 98", "line 99"]

    def test_short_and_missing_files(self, tmp_path: Path) -> None:
        log = tmp_path / "x.log"
        log.write_text("only\n")
        assert tail_lines(log, 40) == ["only"]
        assert tail_lines(tmp_path / "absent.log", 40) == []
        assert tail_lines(log, 0) == []

    def test_reads_only_the_end_of_a_big_file_and_survives_bad_bytes(self, tmp_path: Path) -> None:
        log = tmp_path / "x.log"
        log.write_bytes(b"x" * 1_000_000 + b"\n\xff\xfebroken\nlast\n")
        assert tail_lines(log, 2, max_bytes=100) == ["\ufffd\ufffdbroken", "last"]


def fake_proc(root: Path, pid: int, comm: str, state: str, pgrp: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pgrp} {pgrp} 0 -1 4194560 0 0\n")


def test_group_members_skips_zombies_other_groups_and_odd_names(tmp_path: Path) -> None:
    fake_proc(tmp_path, 100, "python", "S", 100)
    fake_proc(tmp_path, 101, "VLLM::Engine Core (x) )", "R", 100)  # parentheses in the name
    fake_proc(tmp_path, 102, "sleep", "Z", 100)
    fake_proc(tmp_path, 200, "bash", "S", 200)
    (tmp_path / "self").mkdir()
    (tmp_path / "300").mkdir()  # vanished before its stat could be read
    assert sorted(group_members(100, proc_root=tmp_path)) == [100, 101]


def test_startup_error_carries_the_tail(tmp_path: Path) -> None:
    err = StartupError("decode", "exited with status 1", tmp_path / "d.log", ["a", "Traceback: boom"])
    assert err.tail == ["a", "Traceback: boom"]
    assert "decode failed to start: exited with status 1" in str(err)
    assert "    Traceback: boom" in str(err)
    assert "(log is empty)" in str(StartupError("x", "timed out", tmp_path / "x.log", []))


def test_free_port_picks_below_the_ephemeral_range_until_one_binds() -> None:
    picks = iter([20001, 20002, 20003])
    asked: list[tuple[int, str]] = []

    def is_free(port: int, host: str) -> bool:
        asked.append((port, host))
        return port == 20003

    def pick(lo: int, hi: int) -> int:
        assert (lo, hi) == PICK_RANGE and hi <= 32768  # Linux's default ephemeral range starts at 32768
        return next(picks)

    assert free_port("127.0.0.1", pick, is_free) == 20003
    assert asked == [(20001, "127.0.0.1"), (20002, "127.0.0.1"), (20003, "127.0.0.1")]


class Affinities:
    """os.sched_getaffinity / sched_setaffinity over a table of thread ids; `spawn` adds an off-core thread to
    the fake /proc on every move (a group that keeps starting threads)."""

    def __init__(self, table: dict[int, set[int]], spawn: Path | None = None) -> None:
        self.table = table
        self.moved: list[int] = []
        self.spawn = spawn

    def get(self, tid: int) -> set[int]:
        return set(self.table[tid])

    def set(self, tid: int, cores: Iterable[int]) -> None:
        self.table[tid] = set(cores)
        self.moved.append(tid)
        if self.spawn is not None:
            new = 1000 + len(self.moved)
            (self.spawn / str(new)).mkdir()
            self.table[new] = {0, 1}


def patched(monkeypatch: pytest.MonkeyPatch, affinities: Affinities) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", affinities.get)
    monkeypatch.setattr(os, "sched_setaffinity", affinities.set)


def with_tasks(root: Path, pid: int, tids: list[int]) -> Path:
    for tid in tids:
        (root / str(pid) / "task" / str(tid)).mkdir(parents=True)
    return root / str(pid) / "task"


def test_pin_group_moves_every_thread_of_the_group_that_is_off_its_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_proc(tmp_path, 100, "python", "S", 100)
    fake_proc(tmp_path, 101, "VLLM::EngineCore", "S", 100)
    fake_proc(tmp_path, 200, "other", "S", 200)
    with_tasks(tmp_path, 100, [100, 102])
    with_tasks(tmp_path, 101, [101])
    with_tasks(tmp_path, 200, [200])
    affinities = Affinities({100: {0, 1}, 102: {1}, 101: {0}, 200: {0, 1}})
    patched(monkeypatch, affinities)
    pin_group(100, 0, proc_root=tmp_path)
    assert affinities.table == {100: {0}, 102: {0}, 101: {0}, 200: {0, 1}}  # another group is left alone
    assert sorted(affinities.moved) == [100, 102]


def test_pin_group_gives_up_on_a_group_that_keeps_starting_threads_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_proc(tmp_path, 100, "python", "S", 100)
    tasks = with_tasks(tmp_path, 100, [100])
    patched(monkeypatch, Affinities({100: {0, 1}}, spawn=tasks))
    with pytest.raises(RuntimeError, match="kept starting threads"):
        pin_group(100, 0, proc_root=tmp_path, passes=3)
