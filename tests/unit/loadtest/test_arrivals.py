import itertools
import math

import pytest

from loadtest.arrivals import ArrivalSpec, schedule


def test_poisson_mean_gap_matches_rate() -> None:
    times = schedule(ArrivalSpec(qps=4.0, seed=1), 4000)
    assert times[0] == 0.0
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.05)


def test_gamma_burstiness_keeps_mean_and_changes_spread() -> None:
    def gaps(shape: float) -> list[float]:
        t = schedule(ArrivalSpec(qps=2.0, burstiness=shape, seed=3), 4000)
        return [b - a for a, b in itertools.pairwise(t)]

    def cv(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / m

    bursty, poisson, regular = gaps(0.25), gaps(1.0), gaps(8.0)
    for g in (bursty, poisson, regular):
        assert sum(g) / len(g) == pytest.approx(0.5, rel=0.1)
    assert cv(bursty) > cv(poisson) > cv(regular)


def test_same_seed_same_schedule_and_infinite_rate_is_all_at_once() -> None:
    assert schedule(ArrivalSpec(qps=3, seed=7), 20) == schedule(ArrivalSpec(qps=3, seed=7), 20)
    assert schedule(ArrivalSpec(qps=3, seed=7), 20) != schedule(ArrivalSpec(qps=3, seed=8), 20)
    assert schedule(ArrivalSpec(), 5) == [0.0] * 5


def test_duration_cuts_the_schedule() -> None:
    times = schedule(ArrivalSpec(qps=10, seed=0), 10_000, duration_s=2.0)
    assert times and max(times) < 2.0
    assert len(times) < 10_000
    assert schedule(ArrivalSpec(qps=10), 0) == []


def test_rejects_non_positive_rate_and_shape() -> None:
    with pytest.raises(ValueError):
        ArrivalSpec(qps=0)
    with pytest.raises(ValueError):
        ArrivalSpec(qps=1, burstiness=0)


def test_loads_with_the_same_seed_share_one_stream_in_turn() -> None:
    stream = schedule(ArrivalSpec(qps=4.0, seed=5), 400)
    a, b = (schedule(ArrivalSpec(qps=4.0, seed=5, stride=2, phase=k), 200) for k in (0, 1))
    assert sorted(a + b) == stream  # every arrival is sent once, by one of the two
    for j in range(200):  # one arrival of each block of two each
        assert {a[j], b[j]} == {stream[2 * j], stream[2 * j + 1]}
    first = sum(x < y for x, y in zip(a, b, strict=True))
    assert 60 < first < 140  # a coin per block decides who goes first, so neither always does
    assert schedule(ArrivalSpec(qps=4.0, seed=5, stride=1), 400) == stream
    for stride, phase in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError, match="stride"):
            ArrivalSpec(qps=1, stride=stride, phase=phase)


def test_a_shared_stream_is_cut_at_the_duration_like_a_whole_one() -> None:
    stream = schedule(ArrivalSpec(qps=4.0, seed=5), 40)
    mine = schedule(ArrivalSpec(qps=4.0, seed=5, stride=2, phase=1), 100, duration_s=stream[9])
    assert mine and all(t < stream[9] for t in mine) and set(mine) <= set(stream[:10])
