"""Per-rank endpoints: vLLM offsets a tcp port by the DP rank (port 0 stays), suffixes inproc names."""

from __future__ import annotations

import pytest

from router.errors import ConfigError
from router.kv_events.endpoints import RankPublisher, endpoints_for, endpoints_near, offset_for_rank


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"),
        ("tcp://10.0.0.1:5557", 3, "tcp://10.0.0.1:5560"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("tcp://host:0", 2, "tcp://host:0"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_offsets(endpoint: str, rank: int, expected: str) -> None:
    assert offset_for_rank(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank"), [("ipc:///tmp/kv", 1), ("tcp://host", 1), ("tcp://host:x", 1), ("tcp://h:1", -1)]
)
def test_what_cannot_be_offset_is_a_config_error(endpoint: str, rank: int) -> None:
    with pytest.raises(ConfigError):
        offset_for_rank(endpoint, rank)


def test_every_rank_of_a_worker() -> None:
    assert endpoints_for("d0", "tcp://h:5557", "tcp://h:6557", "kv", dp_size=2) == [
        RankPublisher("d0", 0, "tcp://h:5557", "tcp://h:6557", "kv"),
        RankPublisher("d0", 1, "tcp://h:5558", "tcp://h:6558", "kv"),
    ]
    assert endpoints_for("d0", "tcp://h:5557")[0].replay is None


def test_near_a_workers_url() -> None:
    assert endpoints_near("p0", "http://10.1.2.3:8100", 5557, 5558) == [
        RankPublisher("p0", 0, "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "")
    ]
    assert endpoints_near("p0", "http://[fd00::1]:8100", 5557)[0].publisher == "tcp://[fd00::1]:5557"


@pytest.mark.parametrize(
    "call",
    [
        lambda: endpoints_for("w", "http://h:1"),
        lambda: endpoints_for("w", "tcp://h:1", "udp://h:2"),
        lambda: endpoints_for("w", "tcp://h:1", dp_size=0),
        lambda: endpoints_near("w", "not a url", 1),
    ],
)
def test_bad_endpoints_are_config_errors(call: object) -> None:
    with pytest.raises(ConfigError):
        call()  # type: ignore[operator]
