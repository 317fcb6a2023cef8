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
