"""Benchmark metrics as `vllm bench serve` defines them: TTFT, TPOT, ITL, E2E, throughput, goodput."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loadtest.records import ClientRecord

SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile out of range: {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def dist_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """{mean, p50, p90, p99} in milliseconds of values given in seconds; None when there are none."""
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    return {
        "mean": sum(ms) / len(ms),
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:20"] -> {"ttft": 500.0, "tpot": 20.0} (milliseconds, `--goodput` syntax)."""
    out: dict[str, float] = {}
    for spec in specs:
        key, sep, val = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad goodput SLO {spec!r}; use one of {SLO_KEYS} as KEY:MS")
        out[key] = float(val)
    return out


def meets_slos(rec: ClientRecord, slos_ms: Mapping[str, float]) -> bool:
    """A successful request whose TTFT, TPOT and E2E are all within the given SLOs (DistServe goodput)."""
    if not rec.ok:
        return False
    got = {"ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2el": rec.e2e_s}
    for key, limit in slos_ms.items():
        value = got[key]
        if key == "tpot" and value is None:
            continue  # a one-token answer has no TPOT; vllm bench counts it as meeting the TPOT SLO
        if value is None or value * 1000.0 > limit:
            return False
    return True


@dataclass(frozen=True)
class Summary:
    n: int
    completed: int
    failed: int
    duration_s: float
    ttft_ms: dict[str, float] | None
    tpot_ms: dict[str, float] | None
    itl_ms: dict[str, float] | None
    e2e_ms: dict[str, float] | None
    handoff_ms: dict[str, float] | None
    req_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    goodput_req_per_s: float | None
    input_tokens: int
    output_tokens: int


def summarize(
    records: Sequence[ClientRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> Summary:
    """Aggregate a run. Failed requests count in `failed` and in nothing else (as vllm bench serve)."""
    ok = [r for r in records if r.ok]
    dur = duration_s if duration_s > 0 else math.nan
    out_tok = sum(r.output_tokens or 0 for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    good = None if not slos_ms else sum(1 for r in ok if meets_slos(r, slos_ms)) / dur
    return Summary(
        n=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        ttft_ms=dist_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=dist_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=dist_ms([g for r in ok for g in r.itl_s]),
        e2e_ms=dist_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        handoff_ms=dist_ms([r.handoff_ms / 1000.0 for r in ok if r.handoff_ms is not None]),
        req_per_s=len(ok) / dur,
        output_tok_per_s=out_tok / dur,
        total_tok_per_s=(in_tok + out_tok) / dur,
        goodput_req_per_s=good,
        input_tokens=in_tok,
        output_tokens=out_tok,
    )


def paired_ttft(mine: Sequence[ClientRecord], other: Sequence[ClientRecord]) -> dict[str, float] | None:
    """Two loads that took one arrival stream in turn: request j of each came from the same block of
    consecutive arrivals, so they met the same engines. Over the pairs where both succeeded: the median of
    mine - other's TTFT (ms) and the share of pairs where mine was faster. None when no pair succeeded."""
    theirs = {r.index: r.ttft_s for r in other if r.ok and r.ttft_s is not None}
    diffs = [
        1000.0 * (r.ttft_s - theirs[r.index])
        for r in mine
        if r.ok and r.ttft_s is not None and theirs.get(r.index) is not None
    ]
    if not diffs:
        return None
    return {
        "pairs": float(len(diffs)),
        "diff_p50_ms": percentile(diffs, 50),
        "faster_share": sum(d < 0 for d in diffs) / len(diffs),
    }
