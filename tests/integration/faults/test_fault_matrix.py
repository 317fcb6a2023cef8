"""The short fault matrix (loadtest/faults) on real vLLM CPU engines and the hostile stand-ins: every row clean.

The test's form of the run (loadtest.faults.matrix.TEST_FORM): the stand-in rows run while the vLLM bed's engines
start, P's lease on that bed is 10 s instead of 30 s and D's hold deadline (kv_timeout_s) 15 s instead of 30 s, so
a row whose prefill holds blocks no decode will register for, or whose decode quarantines the blocks of a killed
prefill, settles sooner; every row, and what makes it clean, is the table's.

Clean: every client was served or got a clear OpenAI-style error, and afterwards nothing is stuck (engines'
running + waiting requests 0), no counter is held (router in-flight, queued and per-worker gauges 0) and no KV
block is in use (every engine's KV usage 0). Times to outcome are recorded in the table, never asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench.procs import vllm_lock
from loadtest.faults.matrix import TEST_FORM, readme, rows_for, run, write
from tests.integration.support import require_vllm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_every_row_of_the_short_fault_matrix_is_clean(tmp_path: Path) -> None:
    require_vllm()
    with vllm_lock():
        results = run(rows_for(short=True), form=TEST_FORM)
    write(results, tmp_path, short=True)
    assert len(results) == len(rows_for(short=True)), "every row ran"
    not_clean = [r.row["name"] for r in results if not r.clean]
    assert not not_clean, f"rows not clean: {not_clean}\n" + readme(
        results, {"commit": "-", "when": "-", "short": True}
    )
