"""The DP-rank rows' pure part: reading a rank's state from the router's /ready snapshot."""

from __future__ import annotations

from loadtest.faults.dp import rank_usable

P0 = "http://127.0.0.1:1"


def snapshot(healthy: bool, ranks: list[tuple[int, bool]] | None) -> list[dict[str, object]]:
    views = None if ranks is None else [{"rank": r, "usable": u, "in_flight": 0} for r, u in ranks]
    return [
        {"url": "http://127.0.0.1:2", "healthy": True, "ranks": None},
        {"url": P0, "healthy": healthy, "ranks": views},
    ]


def test_a_rank_held_out_alone_or_with_its_whole_server() -> None:
    assert rank_usable(snapshot(True, [(0, True), (1, False)]), P0, 1) is False
    assert rank_usable(snapshot(True, [(0, True), (1, True)]), P0, 1) is True
    assert rank_usable(snapshot(False, [(0, True), (1, True)]), P0, 1) is False  # the server is out
    assert rank_usable(snapshot(True, None), P0, 1) is None  # no ranks stated
    assert rank_usable(snapshot(True, [(0, True)]), "http://elsewhere:1", 0) is None


def test_the_outcome_counts_the_load_requests_the_fault_could_catch() -> None:
    from loadtest.faults.client import Result
    from loadtest.faults.dp import caught

    victims = [Result(200, True, None, 10.5)]
    loaded = [(9.0, Result(200, True, None, 16.0)), (12.0, Result(502, False, "upstream_error", 13.0))]
    loaded.append((20.0, Result(200, True, None, 30.0)))  # started after the hold-out: not caught
    outcome = caught(victims, loaded, t_fault=10.0, held=15.0)
    assert (outcome.acceptable, outcome.fault_to_outcome_s) == (True, 6.0)
    assert outcome.summary == "200 x1; load: 200 x2, 502 x1"
    never_held = caught(victims, [(20.0, Result(None, False, None, 31.0))], t_fault=10.0, held=None)
    assert not never_held.acceptable and never_held.fault_to_outcome_s == 21.0
