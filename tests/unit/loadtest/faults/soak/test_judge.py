"""The soak's verdict as pure code: a trend after warm-up, the noise floors, what is left, unexpected outcomes."""

from __future__ import annotations

from loadtest.faults.soak.judge import Leftover, judge, trend

QUIET = Leftover({"in_flight": 0.0, "queued": 0.0, "worker_in_flight": 0.0}, {"p0": (0.0, 0.0)})


def test_a_steady_rise_after_warm_up_is_a_trend_and_warm_up_growth_is_not() -> None:
    warm = [100.0, 300.0, 500.0]  # allocators and caches fill during warm-up
    flat = [600.0, 602.0, 598.0, 601.0, 599.0, 600.0]
    rising = [600.0, 610.0, 620.0, 640.0, 650.0, 660.0]
    kept = trend("router rss_mib", "rss_mib", warm + flat, warmup=3)
    assert kept is not None and not kept.grows and (kept.first, kept.last) == (601.0, 599.5)
    grew = trend("router rss_mib", "rss_mib", warm + rising, warmup=3)
    assert grew is not None and grew.grows and round(grew.change, 3) == round((655 - 605) / 605, 3)
    assert trend("router rss_mib", "rss_mib", warm + flat, warmup=0) is not None
    assert trend("x", "rss_mib", warm + flat, warmup=0).grows  # type: ignore[union-attr]


def test_a_rise_under_five_percent_or_under_the_noise_floor_is_flat() -> None:
    assert not trend("d fds", "fds", [100, 100, 104, 104, 104, 104], 0).grows  # type: ignore[union-attr]
    assert not trend("d fds", "fds", [10, 10, 16, 16, 16, 16], 0).grows  # type: ignore[union-attr]  # +60 %, 6 fds
    assert trend("d fds", "fds", [10, 10, 30, 30, 30, 30], 0).grows  # type: ignore[union-attr]
    assert not trend("rss", "rss_mib", [1000, 1000, 1040, 1040], 0).grows  # type: ignore[union-attr]  # 4 %
    assert not trend("p0 kv_usage", "kv_usage", [0.0, 0.0, 0.04, 0.04], 0).grows  # type: ignore[union-attr]
    assert trend("p0 kv_usage", "kv_usage", [0.0, 0.0, 0.2, 0.2], 0).grows  # type: ignore[union-attr]


def test_one_spike_in_a_third_does_not_decide_and_a_rise_that_comes_back_is_flat() -> None:
    assert not trend("r", "rss_mib", [500, 500, 500, 500, 900, 500, 500, 500, 500], 0).grows  # type: ignore[union-attr]
    assert not trend("r", "rss_mib", [500, 500, 500, 800, 800, 800, 500, 500, 500], 0).grows  # type: ignore[union-attr]


def test_too_few_samples_after_warm_up_cannot_pass() -> None:
    assert trend("r", "rss_mib", [1.0, 2.0, 3.0, 4.0], warmup=2) is None
    verdict = judge({"r rss_mib": ("rss_mib", [1.0, 2.0])}, 0, QUIET, {})
    assert not verdict.ok and "too few samples" in verdict.reasons()[0]


def test_the_verdict_fails_on_growth_on_anything_left_and_on_unexpected_outcomes() -> None:
    flat = {"router rss_mib": ("rss_mib", [500.0] * 6), "d kv_usage": ("kv_usage", [0.1] * 6)}
    assert judge(flat, 1, QUIET, {"bad": 0}).ok
    grown = judge({**flat, "router fds": ("fds", [50.0, 50.0, 80.0, 80.0, 80.0, 80.0])}, 0, QUIET, {})
    assert not grown.ok and grown.reasons() == ["router fds grew 50 -> 80 (+60.0%)"]
    held = Leftover({"in_flight": 1.0, "queued": 0.0, "worker_in_flight": 0.0}, {"d": (0.0, 0.002)})
    left = judge(flat, 0, held, {})
    assert not left.ok and left.left == ["router in_flight 1", "d KV 0.20%"]
    failed = judge(flat, 0, QUIET, {"chat-json": 2})
    assert not failed.ok and failed.reasons() == ["2 unexpected outcomes of chat-json"]
