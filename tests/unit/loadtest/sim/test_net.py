"""The pair's network on its event clock: where each transfer lands on the FIFO and the fair-share link."""

from __future__ import annotations

import pytest

from loadtest.sim.net import FifoNet, SharedNet
from loadtest.sim.pair import Clock


def landings(net_kind: str, sends: list[tuple[float, float]], start_s: float = 0.0) -> list[float]:
    clock = Clock()
    net = SharedNet(clock, start_s) if net_kind == "shared" else FifoNet(clock)
    ends: dict[int, float] = {}
    for i, (at, seconds) in enumerate(sends):
        net.send(at, seconds, lambda i=i: ends.__setitem__(i, clock.now))  # type: ignore[misc]
    clock.run()
    return [ends[i] for i in range(len(sends))]


def test_two_transfers_at_once_land_together_after_twice_their_time_on_the_shared_link() -> None:
    assert landings("shared", [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([2.0, 2.0])
    assert landings("fifo", [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([1.0, 2.0])


def test_one_after_the_other_they_land_alike_on_both_links() -> None:
    assert landings("shared", [(0.0, 1.0), (1.0, 1.0)]) == pytest.approx([1.0, 2.0])
    assert landings("fifo", [(0.0, 1.0), (1.0, 1.0)]) == pytest.approx([1.0, 2.0])


def test_a_late_joiner_moves_the_first_ones_landing_and_each_pays_the_start() -> None:
    assert landings("shared", [(0.0, 1.0), (0.5, 2.0)]) == pytest.approx([1.5, 3.0])
    assert landings("shared", [(0.0, 1.0)], start_s=0.25) == pytest.approx([1.25])


def test_a_transfer_without_a_callback_still_takes_its_share() -> None:
    clock = Clock()
    net, ends = SharedNet(clock), []
    net.send(0.0, 1.0, None)
    net.send(0.0, 1.0, lambda: ends.append(clock.now))
    clock.run()
    assert ends == pytest.approx([2.0])
