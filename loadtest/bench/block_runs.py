"""How the block ids of our connector's WRITEs fall into runs over one point (issue 44 item 1), from the prefill's
``vllm:kvpush_run_blocks_{prefill,decode,both}`` histograms (one observation per run, in blocks) and
``vllm:kvpush_num_descriptors`` (one per WRITE), read before and after the point. Pure: samples in, a row field out.
"""

from collections.abc import Mapping
from typing import Any

from loadtest import promtext

SIDES = ("prefill", "decode", "both")
DESCRIPTORS = "vllm:kvpush_num_descriptors"


def _buckets(samples: Mapping[promtext.Sample, float], name: str) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over engines."""
    out: dict[float, float] = {}
    for le, v in promtext.by_label(samples, f"{name}_bucket", "le").items():
        out[float(le)] = out.get(float(le), 0.0) + v
    return out


def _side(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float], side: str) -> dict[str, Any]:
    name = f"vllm:kvpush_run_blocks_{side}"
    runs = promtext.total(after, f"{name}_count") - promtext.total(before, f"{name}_count")
    blocks = promtext.total(after, f"{name}_sum") - promtext.total(before, f"{name}_sum")
    b, a = _buckets(before, name), _buckets(after, name)
    cumulative = {le: a.get(le, 0.0) - b.get(le, 0.0) for le in sorted(a)}
    share, below = {}, 0.0
    for le, n in cumulative.items():  # the share of runs per bucket (le 1: single blocks, le 2: runs of 2, ...)
        share[("+Inf" if le == float("inf") else f"{le:g}")] = round((n - below) / runs, 4) if runs else 0.0
        below = n
    return {"runs": runs, "blocks": blocks, "mean": round(blocks / runs, 3) if runs else None, "share": share}


def block_runs(before: Mapping[promtext.Sample, float], after: Mapping[promtext.Sample, float]) -> dict[str, Any]:
    """``{side: {runs, blocks, mean run length, share of runs per bucket}, writes, descriptors_per_write}`` over a
    point; empty when the engine wrote nothing (a pull pair, or a front without our connector)."""
    writes = promtext.total(after, f"{DESCRIPTORS}_count") - promtext.total(before, f"{DESCRIPTORS}_count")
    if writes <= 0:
        return {}
    posted = promtext.total(after, f"{DESCRIPTORS}_sum") - promtext.total(before, f"{DESCRIPTORS}_sum")
    out: dict[str, Any] = {s: _side(before, after, s) for s in SIDES}
    out["writes"] = writes
    out["descriptors_per_write"] = round(posted / writes, 2)
    return out
