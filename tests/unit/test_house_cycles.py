"""No package of the house has an import cycle (lazy and type-only imports included): read with ast, nothing imported.
The rooms' floors are guarded per package (tests/unit/loadtest/test_layout.py, tests/unit/connector/test_rooms.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.loadtest.test_layout import cycles, graph

HOUSE = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["router", "connector", "loadtest", "stack", "kvpush"])
def test_the_package_has_no_import_cycle(package: str) -> None:
    g = graph(HOUSE / package)
    assert g, f"{package}: no modules read"
    assert cycles(g) == []


def test_the_workers_are_a_room_of_the_router() -> None:
    g = graph(HOUSE / "router")
    workers = {m for m in g if m.startswith("router.workers.")}
    assert {"router.workers.pool", "router.workers.health", "router.workers.ranks"} <= workers
    assert not {"router.pool", "router.health", "router.ranks"} & set(g)
