"""The `kv_events:` block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.cli import load_serve_settings
from router.config import build_settings
from router.domain import Role
from router.errors import ConfigError
from router.kv_events.endpoints import RankPublisher
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
        RankPublisher("d0", 0, "tcp://10.0.0.2:6000", "tcp://10.0.0.2:6100", "kv"),
        RankPublisher("d0", 1, "tcp://10.0.0.2:6001", "tcp://10.0.0.2:6101", "kv"),
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


def test_ports_relative_to_each_workers_http_port() -> None:
    found = parse_kv_events({"port_offset": 1000, "replay_offset": 2000, "topic": "kv"})
    assert found.ports("http://h:8100") == (9100, 10100)
    assert found.endpoints("p0", "http://10.0.0.2:8100") == [
        RankPublisher("p0", 0, "tcp://10.0.0.2:9100", "tcp://10.0.0.2:10100", "kv")
    ]
    assert found.endpoints("d", "http://h:8200", dp_size=2)[1] == RankPublisher(
        "d", 1, "tcp://h:9201", "tcp://h:10201", "kv"
    )
    assert json.loads(found.engine_config("http://h:8200"))["endpoint"] == "tcp://*:9200"
    assert found.ports("https://h") == (1443, 2443)  # the scheme's default port
    no_replay = parse_kv_events({"port_offset": -100})
    assert no_replay.endpoints("d", "http://h:8200")[0].replay is None
    with pytest.raises(ConfigError, match="not a TCP port"):
        found.ports("http://h:65000")
    with pytest.raises(ConfigError, match="need the worker's URL"):
        found.engine_config()


@pytest.mark.parametrize(
    "raw",
    [
        {"port_offset": 1000, "port": 5557},
        {"port_offset": 1000, "replay_port": 5558},
        {"replay_offset": 2000},
        {"port_offset": 0},
        {"port_offset": 1000, "replay_offset": 1000},
        {"port_offset": 1000, "replay_offset": 1001, "dp_size": 2},
        {"port_offset": "x"},
    ],
)
def test_bad_offsets_are_config_errors(raw: Any) -> None:
    with pytest.raises(ConfigError):
        parse_kv_events(raw)


def test_the_block_and_the_flags_reach_the_routers_settings(tmp_path: Path) -> None:
    workers = ["--prefill", "http://p:8100", "--decode", "http://d:8200"]
    assert not load_serve_settings(workers, {}).kv_events.enabled
    on = load_serve_settings([*workers, "--kv-events", "--kv-events-port-offset", "1000"], {}).kv_events
    assert (on.enabled, on.port_offset, on.replay_offset) == (True, 1000, None)
    config = tmp_path / "router.yaml"
    config.write_text("kv_events:\n  port_offset: 1000\n  replay_offset: 2000\n  topic: kv\n", encoding="utf-8")
    from_file = load_serve_settings([*workers, "--config", str(config)], {}).kv_events
    assert (from_file.enabled, from_file.replay_offset, from_file.topic) == (True, 2000, "kv")
    off = load_serve_settings([*workers, "--config", str(config), "--no-kv-events"], {}).kv_events
    assert (off.enabled, off.port_offset) == (False, 1000)  # the flag sets one name of the file's block
    with pytest.raises(ConfigError, match="kv_events: expected a mapping"):
        build_settings({"prefill": ["http://p:1"], "decode": ["http://d:2"], "kv_events": True})
