"""Settings: layering (flags > env > file > defaults), prefill specs, validation messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.cli import load_serve_settings
from router.config import Timeouts, build_settings, from_env, parse_prefill_spec
from router.domain import Mode, NixlIdentity, Role
from router.errors import ConfigError

MIN = {"prefill": ["http://p:8100"], "decode": ["http://d:8200"]}


def test_defaults_with_auto_prefill() -> None:
    s = build_settings(MIN)
    assert s.mode is Mode.PUSH
    assert s.prefill[0].identity is None and s.prefill[0].role is Role.PREFILL
    assert s.decode[0].url == "http://d:8200"
    assert s.timeouts == Timeouts()


def test_prefill_spec_with_identity_defaults_host_to_the_url_host() -> None:
    spec = parse_prefill_spec("http://10.0.0.5:8100/,engine_id=p0,side_port=5600,tp=2")
    assert spec.url == "http://10.0.0.5:8100"
    assert spec.identity == NixlIdentity("p0", "10.0.0.5", 5600, 2, 1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("http://p:1,engine_id=p0", "side_port"),
        ("http://p:1,side_port=5600", "engine_id"),
        ("http://p:1,engine_id=p0,side_port=99999", "out of range"),
        ("http://p:1,engine_id=p0,side_port=x", "integer"),
        ("http://p:1,colour=red", "unknown option"),
        ("http://p:1,engine_id", "key=value"),
        ("p:8100", "http"),
        ("http://p:1/v1", "without a path"),
    ],
)
def test_bad_prefill_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_prefill_spec(spec)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"prefill": []}, "no prefill workers"),
        ({"decode": []}, "no decode workers"),
        ({"mode": "sideways"}, "'push' or 'pull'"),
        ({"decode_policy": "fastest"}, "unknown selection policy"),
        ({"timeouts": {"prefill": 0}}, "positive"),
        ({"timeouts": {"forever": 1}}, "unknown name"),
        ({"colour": "red"}, "unknown setting"),
        ({"decode": ["http://p:8100"]}, "both prefill and decode"),
        ({"decode": ["http://d:1", "http://d:1"]}, "listed twice"),
        ({"port": 70000}, "out of range"),
    ],
)
def test_invalid_settings_are_refused_with_a_clear_message(layer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_settings(MIN, layer)


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "mode: pull\nport: 9000\nprefill:\n  - url: http://p:8100\n    engine_id: p0\n    side_port: 5600\n"
        "decode: [http://d:8200]\ntimeouts: {prefill: 10}\npolicy: {decode: round-robin}\n"
    )
    env = {"KVPUSH_PORT": "9100", "KVPUSH_MODE": "push"}
    s = load_serve_settings(["--config", str(config), "--port", "9200", "--timeout", "decode_first_byte=7"], env)
    assert (s.port, s.mode, s.decode_policy) == (9200, Mode.PUSH, "round-robin")
    assert s.prefill[0].identity == NixlIdentity("p0", "p", 5600)
    assert (s.timeouts.prefill, s.timeouts.decode_first_byte) == (10.0, 7.0)


def test_env_lists_are_space_separated() -> None:
    layer = from_env(
        {"KVPUSH_PREFILL": "http://p1:1 http://p2:1,engine_id=e,side_port=5", "KVPUSH_DECODE": "http://d:1"}
    )
    s = build_settings(layer)
    assert [w.url for w in s.prefill] == ["http://p1:1", "http://p2:1"]
    assert s.prefill[1].identity is not None


def test_cli_reports_a_broken_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_serve_settings(["--config", str(bad)], {})
