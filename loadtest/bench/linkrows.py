"""The link suite's decisions, pure: which steps run in which order, how hard a step may load the link, and
what a row learns from the engines' counters (measured transfer time, the bytes check's verdict).

A step is one (prompt length, preset) pair: the suite calibrates the link once per step (P's prefill measured,
the preset resolved, the link reshaped live), then runs every QPS point of the step `repeats` times, the fronts
in one order on even repeats and reversed on odd ones. The headline step (the targets' preset at the first
prompt length) runs the plan's `qps` with `repeats`; the others run `side_qps` with `side_repeats`, each QPS
capped so that neither P nor the link is loaded past `max_load` (a 25g-like link carries one 1024-token prompt
in ~4.4 prefills: 1 QPS would only measure a growing queue).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

XFER_METRICS = ("vllm:kvpush_xfer_time_seconds", "vllm:nixl_xfer_time_seconds")  # ours (P), upstream (P or D)


@dataclass(frozen=True)
class Step:
    """One calibration of the link and the points measured under it."""

    input_len: int
    preset: str
    qps: tuple[float, ...]  # as planned; `capped_qps` applies the measured prefill and transfer
    repeats: int
    headline: bool  # the step that carries the targets


def steps(
    input_lens: Sequence[int],
    presets: Sequence[str],
    qps: Sequence[float],
    repeats: int,
    side_qps: Sequence[float],
    side_repeats: int,
) -> list[Step]:
    """The headline step first (presets[0], input_lens[0]), then the other presets, then the other lengths."""
    if not input_lens or not presets:
        raise ValueError("link suite: need at least one prompt length and one preset")
    if repeats < 1 or side_repeats < 1:
        raise ValueError("link suite: repeats must be >= 1")
    out = []
    for i, n in enumerate(input_lens):
        for j, name in enumerate(presets):
            head = i == 0 and j == 0
            out.append(Step(n, name, tuple(qps if head else side_qps), repeats if head else side_repeats, head))
    return out


SEED_BASE = 4000


def point_seed(step_index: int, qps_index: int) -> int:
    """The arrival seed of a point: the `qps_index`-th QPS of the `step_index`-th step (every repeat and front
    of the point sends on the same schedule). Rows record it (`seed`); the report replays it in the simulator."""
    if step_index < 0 or not 0 <= qps_index < 10:
        raise ValueError(f"need step_index >= 0 and 0 <= qps_index < 10, got {step_index} and {qps_index}")
    return SEED_BASE + 10 * step_index + qps_index


def capped_qps(qps: float, prefill_s: float, transfer_s: float | None, max_load: float) -> float:
    """`qps`, or less: at most `max_load` of what the busier of P (one prefill at a time) and the link carries."""
    if not max_load > 0:
        raise ValueError("max_load must be positive")
    busiest = max(prefill_s, transfer_s or 0.0)
    if busiest <= 0:
        return qps
    cap = max_load / busiest
    return qps if qps <= cap else math.floor(cap * 100) / 100 or 0.01


def n_for(qps: float, requests: int, max_point_s: float, least: int = 4) -> int:
    """Requests at a point: `requests`, or fewer so that a point lasts about `max_point_s` (at least `least`)."""
    if max_point_s <= 0:
        return requests
    return max(least, min(requests, math.ceil(qps * max_point_s)))


def transfer_times(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, Any]:
    """Mean KV transfer time over a row from the connectors' histograms: `before`/`after` map
    "engine:metric" to (sum seconds, count); the engine whose histogram grew most is the one that timed them."""
    best: tuple[float, float, str] | None = None
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        dc, ds = c1 - c0, s1 - s0
        if dc > 0 and (best is None or dc > best[0]):
            best = (dc, ds, key)
    if best is None:
        return {"xfer_ms_mean": None, "xfer_count": 0, "xfer_source": None}
    dc, ds, key = best
    return {"xfer_ms_mean": round(1000 * ds / dc, 3), "xfer_count": int(dc), "xfer_source": key}


def kv_bytes(sources: Mapping[str, float] | None, kv_bytes_per_token: int) -> int:
    """KV bytes D received by transfer over a row (its external_kv_transfer prompt tokens x bytes per token)."""
    return int((sources or {}).get("external_kv_transfer", 0.0)) * kv_bytes_per_token


def outputs_agree(reference: Sequence[str], got: Sequence[str | None]) -> list[int]:
    """[equal, compared]: greedy answers through a front against the same prompts on one instance alone."""
    pairs = list(zip(reference, got, strict=True))
    return [sum(1 for a, b in pairs if b is not None and a == b), len(pairs)]


WIRE_SHARE = 0.10  # issue 21 item 3: our connector's transfer within 10 % of a bare NIXL WRITE ...
WIRE_SLACK_S = 0.002  # ... or within 2 ms of it


def wire_verdict(connector_s: Sequence[float], bare_s: Sequence[float]) -> dict[str, Any]:
    """Our connector's transfer time against a bare NIXL WRITE of the same bytes on the same link: medians, their
    ratio and whether the connector is within 10 % or 2 ms of bare NIXL."""
    if not connector_s or not bare_s:
        raise ValueError("need at least one connector and one bare NIXL transfer time")
    conn, bare = _median(connector_s), _median(bare_s)
    limit = max(bare * (1 + WIRE_SHARE), bare + WIRE_SLACK_S)
    return {
        "wire_connector_ms": round(1000 * conn, 3),
        "wire_bare_ms": round(1000 * bare, 3),
        "wire_ratio": round(conn / bare, 4) if bare > 0 else None,
        "wire_limit_ms": round(1000 * limit, 3),
        "wire_ok": conn <= limit,
    }


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
