"""Fixtures shared by the transfer-thread tests (the helpers they build on live in test_transfer_thread.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector.transfer.memory import MemoryFabric
from tests.unit.connector.test_transfer_thread import Side, make_side


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    """A prefill side (seeded KV) and a decode side (zeroed KV) on one in-memory fabric, closed after the test."""
    fabric = MemoryFabric()
    p, d = make_side(fabric, "P", seed=1), make_side(fabric, "D", seed=None)
    yield p, d
    d.thread.close()
    p.thread.close()
