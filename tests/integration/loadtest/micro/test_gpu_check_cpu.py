"""The GPU check on this machine's DRAM (``--device cpu``), so the program a GPU session will run
cannot rot: two processes, real NIXL (UCX over loopback), SHA-256 of every block. Plus NIXL's
compressed (strided) descriptor rows, checked to address the same blocks as the full list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from connector.transfer.layout import descriptor_indices, region_descriptors, strided_descriptors
from connector.wire.metadata import KVLayout, Region

pytestmark = pytest.mark.integration
pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parents[4]


def run_check(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "result.json"
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.micro.gpu_check",
            "--device",
            "cpu",
            "--deadline",
            "90",
            "--json",
            str(out),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, result, proc.stdout + proc.stderr[-4000:]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_the_check_passes_on_dram_and_verifies_every_block(tmp_path: Path, layout: str) -> None:
    rc, result, output = run_check(tmp_path, "--layout", layout)
    assert rc == 0, output
    assert result["ok"] and not result["failures"]
    assert {peer["mem_type"] for peer in result["peers"].values()} == {"DRAM"}
    assert {peer["layout"] for peer in result["peers"].values()} == {layout}
    rounds = {row["name"]: row for row in result["rounds"]}
    assert set(rounds) == {"bulk", "scattered", "prefix-hit"}
    for row in rounds.values():
        assert row["state"] == "DONE" and row["verified"] == row["blocks"] > 0 and row["mismatched"] == []
    assert len(rounds["bulk"]["write_s"]) == result["config"]["reps"]
    assert rounds["prefix-hit"]["blocks"] < result["config"]["write_blocks"]
    assert result["untouched_nonzero_bytes"] == 0
    assert "kvpush GPU check: PASS" in output


def test_a_corrupted_block_fails_the_check(tmp_path: Path) -> None:
    rc, result, output = run_check(tmp_path, "--corrupt")
    assert rc == 1, output
    assert not result["ok"]
    bulk = next(row for row in result["rounds"] if row["name"] == "bulk")
    assert bulk["verified"] == bulk["blocks"] - 1 and len(bulk["mismatched"]) == 1
    assert any("blocks differ on D" in f for f in result["failures"])
    assert "kvpush GPU check: FAIL" in output


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 4)], ids=["P2-D1", "P1-D4"])
def test_a_tp_pair_as_rank_processes_writes_each_leg_s_head_slices(tmp_path: Path, p_tp: int, d_tp: int) -> None:
    """--p-tp/--d-tp: one process per rank, each holding its heads of the CPU defaults' 2 (P2-D1: each P rank
    writes its head into a slice of D's blocks; P1-D4: heads replicated on D, P writes each D rank's copy), every
    leg's byte ranges SHA-256-checked on D, untouched blocks zero."""
    rc, result, output = run_check(tmp_path, "--p-tp", str(p_tp), "--d-tp", str(d_tp))
    assert rc == 0, output
    assert set(result["peers"]) == {*(f"P{r}" for r in range(p_tp)), *(f"D{r}" for r in range(d_tp))}
    assert len(result["legs"]) == max(p_tp, d_tp)
    assert all(len(leg["slices"]) == 1 for leg in result["legs"])  # one head per leg, a byte range of each block
    rounds = {row["name"]: row for row in result["rounds"]}
    assert set(rounds) == {"bulk", "scattered", "prefix-hit"}
    for row in rounds.values():
        assert row["state"] == "DONE" and row["verified"] == row["slices"] == row["blocks"] * len(result["legs"])
        assert row["mismatched"] == []
    assert result["untouched_nonzero_bytes"] == 0
    assert "kvpush GPU check: PASS" in output


def test_a_corrupted_slice_fails_the_tp_check(tmp_path: Path) -> None:
    rc, result, output = run_check(tmp_path, "--p-tp", "2", "--d-tp", "1", "--corrupt")
    assert rc == 1, output
    bulk = next(row for row in result["rounds"] if row["name"] == "bulk")
    assert bulk["verified"] == bulk["slices"] - 1 and len(bulk["mismatched"]) == 1
    assert "kvpush GPU check: FAIL" in output


def test_strided_descriptor_rows_address_the_same_blocks_as_the_full_list() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from nixl._api import nixl_agent, nixl_agent_config

    regions, blocks, block_len = 3, 8, 256
    src = np.random.default_rng(1).integers(0, 256, regions * blocks * block_len, dtype=np.uint8)
    dst = np.zeros_like(src)

    def layout(buf: np.ndarray[Any, Any]) -> KVLayout:
        starts = [buf.ctypes.data + r * blocks * block_len for r in range(regions)]
        return KVLayout("DRAM", 0, 16, tuple(Region(start, block_len, blocks) for start in starts))

    config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("strided-a", config), nixl_agent("strided-b", config)
    a.register_memory(np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.uint64), "DRAM")
    b.register_memory(np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.uint64), "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    src_blocks, dst_blocks = (1, 2, 7), (5, 0, 3)
    for make in (region_descriptors, strided_descriptors):
        dst[:] = 0
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", make(layout(src)), "DRAM")
        remote = a.prep_xfer_dlist("strided-b", make(layout(dst)), "DRAM")
        xfer = a.make_prepped_xfer(
            "WRITE",
            local,
            descriptor_indices(layout(src), src_blocks),
            remote,
            descriptor_indices(layout(dst), dst_blocks),
            b"",
        )
        state = a.transfer(xfer)
        end = time.monotonic() + 10
        while state == "PROC" and time.monotonic() < end:  # no progress threads: both agents progress here
            b.get_new_notifs()
            state = a.check_xfer_state(xfer)
        assert state == "DONE", make.__name__
        xfer.release()
        s, d = src.reshape(regions, blocks, block_len), dst.reshape(regions, blocks, block_len)
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            assert np.array_equal(d[:, db], s[:, sb]), make.__name__
        untouched = [blk for blk in range(blocks) if blk not in dst_blocks]
        assert not d[:, untouched].any(), make.__name__
        local.release()
        remote.release()
