import math

import pytest

from loadtest.records import ClientRecord
from loadtest.stats import dist_ms, meets_slos, paired_ttft, parse_goodput, percentile, summarize


def rec(i: int, ttft: float, e2e: float, out: int = 5, ok: bool = True, itl: list[float] | None = None) -> ClientRecord:
    return ClientRecord(
        index=i, request_id=str(i), ok=ok, ttft_s=ttft, e2e_s=e2e, output_tokens=out, prompt_tokens=10, itl_s=itl or []
    )


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    r = rec(0, ttft=0.100, e2e=0.500, out=5)
    assert r.tpot_s == pytest.approx(0.1)
    assert rec(1, 0.1, 0.1, out=1).tpot_s is None
    assert rec(2, 0.1, 0.5, ok=False).tpot_s is None


def test_summary_counts_failures_and_scores_only_successes() -> None:
    records = [rec(0, 0.1, 0.5, itl=[0.1, 0.1, 0.2]), rec(1, 0.3, 0.7, itl=[0.4]), rec(2, 9.0, 9.0, ok=False)]
    s = summarize(records, duration_s=2.0)
    assert (s.n, s.completed, s.failed) == (3, 2, 1)
    assert s.ttft_ms is not None and s.ttft_ms["mean"] == pytest.approx(200.0)
    assert s.tpot_ms is not None and s.tpot_ms["p50"] == pytest.approx(100.0)
    assert s.itl_ms is not None and s.itl_ms["mean"] == pytest.approx(200.0)
    assert s.req_per_s == 1.0
    assert s.output_tok_per_s == 5.0 and s.total_tok_per_s == 15.0
    assert s.handoff_ms is None and s.goodput_req_per_s is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_goodput(["ttft:150", "tpot:120"])
    fast, slow_first, slow_tokens = rec(0, 0.1, 0.5), rec(1, 0.2, 0.6), rec(2, 0.1, 1.0)
    assert meets_slos(fast, slos) and not meets_slos(slow_first, slos) and not meets_slos(slow_tokens, slos)
    s = summarize([fast, slow_first, slow_tokens], duration_s=1.0, slos_ms=slos)
    assert s.goodput_req_per_s == 1.0
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_dist_of_nothing_is_none() -> None:
    assert dist_ms([]) is None
    d = dist_ms([0.001, 0.003])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def test_paired_ttft_compares_request_j_of_each_load_where_both_succeeded() -> None:
    mine = [rec(0, 0.100, 1.0), rec(1, 0.300, 1.0), rec(2, 0.200, 1.0), rec(3, 0.050, 1.0, ok=False)]
    other = [rec(0, 0.110, 1.0), rec(1, 0.290, 1.0), rec(2, 0.230, 1.0), rec(3, 0.500, 1.0)]
    paired = paired_ttft(mine, other)
    assert paired is not None
    assert paired["pairs"] == 3  # pair 3 failed on one side
    assert paired["diff_p50_ms"] == pytest.approx(-10.0)  # of -10, +10, -30
    assert paired["faster_share"] == pytest.approx(2 / 3)
    assert paired_ttft(mine, []) is None
