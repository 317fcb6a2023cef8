"""`python -m loadtest.faults [--short] [--out DIR] [--bed vllm|standin] [--row NAME]`: run the fault matrix."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import get_args

from loadtest.faults.matrix import OUT, RowResult, rows_for, run, write
from loadtest.faults.rows import Bed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.faults", description=__doc__)
    p.add_argument("--short", action="store_true", help="the rows make test runs")
    p.add_argument("--out", type=Path, default=OUT, help=f"where matrix.json and README.md go (default {OUT})")
    p.add_argument("--bed", choices=get_args(Bed), help="only the rows of one bed")
    p.add_argument("--row", action="append", default=[], help="only the named row(s)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the rows
    rows = [r for r in rows_for(a.short) if (a.bed is None or r.bed == a.bed) and (not a.row or r.name in a.row)]

    def progress(result: RowResult) -> None:
        o = result.outcome
        print(
            f"{result.row['name']:32} {o['summary']:28} {o['fault_to_outcome_s']:7.2f} s  "
            f"{'clean' if result.clean else 'NOT CLEAN'}",
            flush=True,
        )

    from loadtest.bench.procs import vllm_lock

    if any(r.bed != "standin" for r in rows):
        with vllm_lock():
            results = run(rows, progress)
    else:
        results = run(rows, progress)
    write(results, a.out, a.short)
    print(f"{sum(r.clean for r in results)} of {len(results)} rows clean; wrote {a.out}/matrix.json and README.md")
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
