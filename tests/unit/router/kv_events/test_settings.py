"""The `kv_events:` block."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.domain import Role
from router.errors import ConfigError
from router.kv_events.endpoints import Endpoint
from router.kv_events.settings import KvEventSettings, parse_kv_events


def test_absent_is_off() -> None:
    assert parse_kv_events(None) == KvEventSettings() and not KvEventSettings().enabled


def test_a_full_block() -> None:
    found = parse_kv_events(
        {
            "roles": ["decode"],
            "port": "6000",
            "replay_port": 6100,
            "topic": "kv",
            "dp_size": 2,
            "max_blocks_per_stream": 1000,
            "max_frame_bytes": 65536,
            "replay_timeout": 0.5,
            "max_held": 8,
        }
    )
    assert found == KvEventSettings(True, (Role.DECODE,), 6000, 6100, "kv", 2, 1000, 65536, 0.5, 8)
    assert found.endpoints("d0", "http://10.0.0.2:8200") == [
        Endpoint("d0", 0, "tcp://10.0.0.2:6000", "tcp://10.0.0.2:6100", "kv"),
        Endpoint("d0", 1, "tcp://10.0.0.2:6001", "tcp://10.0.0.2:6101", "kv"),
    ]
    limits = found.limits()
    assert (limits.stream.max_frame_bytes, limits.stream.replay_timeout_s, limits.stream.max_held) == (65536, 0.5, 8)
    assert json.loads(found.engine_config()) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6100",
        "topic": "kv",
    }
    assert parse_kv_events(found) is found


def test_no_replay_port() -> None:
    found = parse_kv_events({"replay_port": None})
    assert found.enabled and found.endpoints("p", "http://h:1")[0].replay is None
    assert json.loads(found.engine_config())["replay_endpoint"] is None


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"colour": 1},
        {"enabled": "yes"},
        {"port": 0},
        {"replay_port": 70000},
        {"port": 5557, "replay_port": 5558, "dp_size": 2},
        {"port": 65535, "dp_size": 2, "replay_port": None},
        {"dp_size": 0},
        {"topic": 3},
        {"roles": []},
        {"roles": ["router"]},
        {"roles": "decode"},
        {"max_blocks_per_stream": 0},
        {"max_frame_bytes": 10},
        {"replay_timeout": 0},
        {"max_held": 0},
    ],
)
def test_bad_blocks_are_config_errors(raw: Any) -> None:
    with pytest.raises(ConfigError):
        parse_kv_events(raw)
