"""How the rank row finds the TP rank to kill (no sockets): the one process of the engine's group titled
VLLM::Worker_TP1, never a guess among several."""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.faults.ranks import group_members, rank_pid


def test_the_rank_is_the_one_process_carrying_its_title() -> None:
    members = {10: "vllm serve /m --port 1", 11: "VLLM::Worker_TP0", 12: "VLLM::Worker_TP1", 13: "VLLM::EngineCore"}
    assert rank_pid(members) == 12


def test_no_rank_or_several_give_none() -> None:
    assert rank_pid({10: "vllm serve", 11: "VLLM::Worker_TP0"}) is None
    assert rank_pid({12: "VLLM::Worker_TP1", 14: "VLLM::Worker_TP1"}) is None


def test_the_group_members_include_this_process_with_its_command_line() -> None:
    members = group_members(os.getpgid(0))
    # pytest-xdist retitles its workers: the process's own /proc cmdline is the reference, not "python"
    own = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    assert members.get(os.getpid()) == own
