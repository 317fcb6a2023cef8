"""The soak's command line: durations."""

from __future__ import annotations

from loadtest.faults.soak.__main__ import seconds


def test_durations() -> None:
    assert (seconds("90s"), seconds("45m"), seconds("1h"), seconds("30")) == (90.0, 2700.0, 3600.0, 30.0)
