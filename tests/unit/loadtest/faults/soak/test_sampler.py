"""The soak's sampler, pure parts: series kinds by name, the WRITE shape between two readings."""

from __future__ import annotations

from loadtest.faults.soak.sampler import series_kind, shape_between


def test_series_kinds() -> None:
    assert series_kind("faults-p0 rss_mib") == "rss_mib" and series_kind("router in_flight") == "in_flight"


def test_the_write_shape_is_the_means_between_two_readings() -> None:
    runs = "vllm:kvpush_run_blocks_both"
    before = {"writes": 10.0, "descriptors": 40.0, "bytes": 4000.0, f"{runs} sum": 80.0, f"{runs} count": 20.0}
    after = {"writes": 20.0, "descriptors": 100.0, "bytes": 10000.0, f"{runs} sum": 200.0, f"{runs} count": 50.0}
    assert shape_between(before, after) == {
        "writes": 10.0,
        "descriptors per WRITE": 6.0,
        "bytes per descriptor": 100.0,
        f"{runs} mean": 4.0,
    }
    assert shape_between(after, after) == {"writes": 0.0}
