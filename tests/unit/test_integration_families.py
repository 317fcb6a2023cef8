"""The shared engine families of the integration suite (tests/integration/families.py), without engines: when the
pool reuses, starts or restarts a family, and the run order that keeps a family's users next to each other."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.integration.families import UPSTREAM_PUSH, Family, FamilyPool, FamilySpec, Step, order_by_family, plan

OTHER = FamilySpec("other", "NixlConnector")


class FakeStarts:
    """A starter that records starts and stops instead of running engines."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.exited = False

    @contextlib.contextmanager
    def __call__(self, spec: FamilySpec) -> Iterator[Family]:
        self.events.append(f"start {spec.label}")
        try:
            yield Family(spec, engines=None, exited=lambda: self.exited)  # type: ignore[arg-type]
        finally:
            self.events.append(f"stop {spec.label}")


def live(spec: FamilySpec) -> Family:
    return Family(spec, engines=None)  # type: ignore[arg-type]


def test_plan_reuses_only_a_usable_family_of_the_same_spec_unless_asked_for_a_fresh_one() -> None:
    assert plan(None, UPSTREAM_PUSH) is Step.START
    assert plan(live(UPSTREAM_PUSH), UPSTREAM_PUSH) is Step.REUSE
    assert plan(live(UPSTREAM_PUSH), UPSTREAM_PUSH, fresh=True) is Step.RESTART
    assert plan(live(UPSTREAM_PUSH), OTHER) is Step.RESTART
    spoiled = live(UPSTREAM_PUSH)
    spoiled.spoil()
    assert plan(spoiled, UPSTREAM_PUSH) is Step.RESTART
    dead = Family(UPSTREAM_PUSH, engines=None, exited=lambda: True)  # type: ignore[arg-type]
    assert plan(dead, UPSTREAM_PUSH) is Step.RESTART


def test_the_pool_keeps_one_family_live_and_stops_it_before_starting_another() -> None:
    starts = FakeStarts()
    with FamilyPool(starts) as pool:
        first = pool.get(UPSTREAM_PUSH)
        assert pool.get(UPSTREAM_PUSH) is first
        pool.get(OTHER)
        assert starts.events == ["start up", "stop up", "start other"]
        pool.release()
        assert pool.live is None
        pool.get(UPSTREAM_PUSH)
    assert starts.events[-3:] == ["stop other", "start up", "stop up"]
    assert pool.starts == ["up", "other", "up"]


def test_a_spoiled_or_dead_family_is_restarted_for_its_next_user() -> None:
    starts = FakeStarts()
    with FamilyPool(starts) as pool:
        pool.get(UPSTREAM_PUSH).spoil()
        second = pool.get(UPSTREAM_PUSH)
        starts.exited = True
        third = pool.get(UPSTREAM_PUSH)
        assert third is not second
    assert starts.events == ["start up", "stop up", "start up", "stop up", "start up", "stop up"]


def test_a_failed_start_leaves_nothing_live() -> None:
    @contextlib.contextmanager
    def failing(spec: FamilySpec) -> Iterator[Family]:
        raise RuntimeError(f"{spec.label} did not start")
        yield live(spec)

    pool = FamilyPool(failing)
    with pytest.raises(RuntimeError):
        pool.get(UPSTREAM_PUSH)
    assert pool.live is None and pool.starts == []


def test_a_familys_items_move_up_to_its_first_one_and_the_ones_that_spoil_it_run_last() -> None:
    keys = [
        (None, False),  # 0
        ("up", False),  # 1
        (None, False),  # 2
        ("up", True),  # 3: spoils
        ("k", True),  # 4
        ("up", False),  # 5
        (None, False),  # 6
        ("k", False),  # 7
    ]
    assert order_by_family(keys) == [0, 1, 5, 3, 2, 7, 4, 6]
    assert order_by_family([(None, False)] * 3) == [0, 1, 2]
