"""How the rank row finds the TP rank to kill (no sockets): the one process of the engine's group titled
VLLM::Worker_TP1, never a guess among several."""

from __future__ import annotations

import os

from loadtest.faults.ranks import group_members, rank_pid


def test_the_rank_is_the_one_process_carrying_its_title() -> None:
    members = {10: "vllm serve /m --port 1", 11: "VLLM::Worker_TP0", 12: "VLLM::Worker_TP1", 13: "VLLM::EngineCore"}
    assert rank_pid(members) == 12


def test_no_rank_or_several_give_none() -> None:
    assert rank_pid({10: "vllm serve", 11: "VLLM::Worker_TP0"}) is None
    assert rank_pid({12: "VLLM::Worker_TP1", 14: "VLLM::Worker_TP1"}) is None


def test_the_group_members_include_this_process_with_its_command_line() -> None:
    members = group_members(os.getpgid(0))
    assert os.getpid() in members and "python" in members[os.getpid()]
