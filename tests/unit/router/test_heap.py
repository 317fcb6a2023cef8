from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from router import heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap back in the collector's walks


@pytest.mark.usefixtures("unfrozen")
def test_settle_freezes_what_lives_and_collects_start_ups_garbage_first() -> None:
    kept, dropped = _Node(), _Node()
    kept.other, dropped.other = _Node(), _Node()
    assert kept.other is not None and dropped.other is not None
    kept.other.other, dropped.other.other = kept, dropped  # two reference cycles
    gone = weakref.ref(dropped)
    del dropped
    gc.disable()  # no collection between the drop and settle's own
    try:
        assert gone() is not None  # a cycle: only a collection frees it
        frozen = heap.settle()
    finally:
        gc.enable()
    assert gone() is None  # collected, not frozen
    assert frozen == gc.get_freeze_count() > 0
    assert kept.other.other is kept
