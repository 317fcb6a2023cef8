"""The simulator's links: a FIFO calendar, and the fair-share link where overlapping transfers share the rate."""

from __future__ import annotations

import math

import pytest

from loadtest.sim.link import FairShare, Fifo, finish_times, tcp_start_s


def test_two_transfers_at_once_each_take_twice_as_long() -> None:
    assert finish_times([(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([2.0, 2.0])


def test_one_after_the_other_each_takes_its_time_alone() -> None:
    assert finish_times([(0.0, 1.0), (1.0, 1.0)]) == pytest.approx([1.0, 2.0])
    assert finish_times([(5.0, 0.5), (0.0, 1.0)]) == pytest.approx([5.5, 1.0])


def test_a_transfer_that_joins_halfway_slows_the_first_only_while_they_overlap() -> None:
    # A alone 0..0.5 (half done); both at half rate until A ends at 1.5; B then alone: 2 - 0.5 = 1.5 left -> 3.0
    assert finish_times([(0.0, 1.0), (0.5, 2.0)]) == pytest.approx([1.5, 3.0])


def test_the_short_transfer_of_two_ends_first_and_the_link_is_never_idle_while_busy() -> None:
    ends = finish_times([(0.0, 3.0), (0.0, 1.0), (0.0, 1.0)])
    assert ends == pytest.approx([5.0, 3.0, 3.0])
    assert max(ends) == pytest.approx(5.0)  # work-conserving: the total work, as a FIFO would finish it


def test_the_link_drains_only_what_ended_and_refuses_to_go_back() -> None:
    link = FairShare()
    a = link.add(0.0, 1.0)
    b = link.add(0.0, 3.0)
    assert link.next_finish() == pytest.approx(2.0) and link.in_flight == 2
    link.advance(1.0)
    assert link.drain() == []
    link.advance(2.0)
    assert [(t, round(e, 9)) for t, e in link.drain()] == [(a, 2.0)]
    assert link.next_finish() == pytest.approx(4.0)
    link.advance(4.0)
    assert [(t, round(e, 9)) for t, e in link.drain()] == [(b, 4.0)] and link.next_finish() is None
    assert link.busy_s == pytest.approx(4.0)
    with pytest.raises(ValueError):
        link.advance(3.0)
    with pytest.raises(ValueError):
        link.add(5.0, math.inf)


def test_an_empty_transfer_ends_where_it_starts() -> None:
    link = FairShare()
    t = link.add(1.0, 0.0)
    assert link.drain() == [(t, 1.0)] and link.next_finish() is None


def test_fifo_serves_one_at_a_time() -> None:
    fifo = Fifo()
    assert fifo.reserve(0.0, 1.0) == 1.0 and fifo.reserve(0.0, 1.0) == 2.0


def test_tcp_start_is_a_round_trip_plus_slow_starts_doublings_to_the_bdp() -> None:
    assert tcp_start_s(0.0, 1e9) == 0.0 and tcp_start_s(1e-3, math.inf) == 0.0
    assert tcp_start_s(40e-6, 8e6) == pytest.approx(40e-6)  # BDP 320 B < initial window: no ramp
    # 1 GB/s x 1 ms = 1 MB: log2(1e6 / 14480) = 6.1 -> 7 doublings
    assert tcp_start_s(1e-3, 1e9) == pytest.approx(8e-3)
    with pytest.raises(ValueError):
        tcp_start_s(-1.0, 1e9)
