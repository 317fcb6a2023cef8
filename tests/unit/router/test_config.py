"""Settings: layering (flags > env > file > defaults), prefill specs, validation messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.cli import load_serve_settings
from router.config import (
    Limits,
    Timeouts,
    build_settings,
    decode_from_mapping,
    from_env,
    parse_decode_url,
    parse_prefill_spec,
    prefill_from_mapping,
    with_environment,
)
from router.decider import NoDecider
from router.deciders import registry
from router.discovery.settings import Discovery, DnsConfig, KubernetesConfig
from router.domain import Fallback, Mode, NixlIdentity, Role, WorkerSpec
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
        ("http://p:1,engine_id=p0,side_port=x", "port number"),
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


def test_the_drain_delay_comes_from_the_environment_below_the_flag() -> None:
    """KVPUSH_DRAIN_DELAY sets drain_delay (0 turns it off: the listener closes at once); --drain-delay wins."""
    assert build_settings(MIN).drain_delay == 3.0
    assert build_settings(MIN, from_env({"KVPUSH_DRAIN_DELAY": "0"})).drain_delay == 0.0
    assert build_settings(MIN, from_env({"KVPUSH_DRAIN_DELAY": "0.5"})).drain_delay == 0.5
    flags = ["--prefill", "http://p:1", "--decode", "http://d:1", "--drain-delay", "2"]
    assert load_serve_settings(flags, {"KVPUSH_DRAIN_DELAY": "0"}).drain_delay == 2.0
    with pytest.raises(ConfigError, match="drain_delay"):
        build_settings(MIN, from_env({"KVPUSH_DRAIN_DELAY": "soon"}))


def test_cli_reports_a_broken_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_serve_settings(["--config", str(bad)], {})


def test_client_deadlines_and_limits_have_their_documented_defaults() -> None:
    s = build_settings(MIN)
    assert (s.timeouts.client_body, s.timeouts.client_write_stall) == (10.0, 30.0)
    assert s.limits == Limits(
        max_body_bytes=16 * 2**20,
        max_header_bytes=32 * 2**10,
        max_headers=100,
        max_request_id_chars=128,
        max_event_bytes=8 * 2**20,
        max_json_depth=64,
    )


def test_limits_come_from_a_block_like_timeouts_and_later_layers_win() -> None:
    s = build_settings(MIN, {"limits": {"max_body_bytes": 1024, "max_headers": "50"}}, {"limits": {"max_headers": 7}})
    assert (s.limits.max_body_bytes, s.limits.max_headers, s.limits.max_json_depth) == (1024, 7, 64)
    s = build_settings(MIN, {"timeouts": {"client_body": 2, "client_write_stall": "3.5"}})
    assert (s.timeouts.client_body, s.timeouts.client_write_stall) == (2.0, 3.5)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"limits": {"max_body": 1}}, r"limits: unknown name\(s\) \['max_body'\]"),
        ({"limits": {"max_body_bytes": 0}}, r"limits\.max_body_bytes: 0 is out of range"),
        ({"limits": {"max_headers": True}}, r"limits\.max_headers: expected an integer"),
        ({"limits": {"max_json_depth": 2.5}}, "expected an integer"),
        ({"limits": [1]}, "limits: expected a mapping"),
        ({"timeouts": {"client_body": True}}, "number of seconds"),
        ({"retries": True}, "retries: expected an integer"),
        ({"health_interval": True}, "health_interval: expected a number of seconds"),
        ({"health_interval": "inf"}, "finite"),
        ({"fallback": "prefill-only"}, "'none' or 'decode-only'"),
        ({"decider": "psychic"}, r"unknown decider 'psychic'; known deciders: .*\bnone\b"),
        ({"decider": {"colour": "red"}}, "decider: expected a name or a mapping with name"),
        ({"decider": 3}, "decider: expected a name"),
    ],
)
def test_new_settings_are_validated(layer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_settings(MIN, layer)


def test_fallback_is_an_enum_equal_to_its_string() -> None:
    s = build_settings(MIN, {"fallback": "decode-only"})
    assert s.fallback is Fallback.DECODE_ONLY
    as_text: str = "decode-only"  # typed as str: the enum member compares equal to its plain string
    assert s.fallback == as_text
    assert build_settings(MIN).fallback is Fallback.NONE


def test_the_decider_is_a_name_or_a_mapping_with_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def factory(options: Any, view: Any) -> NoDecider:
        if "bad" in options:
            raise ConfigError("decider prefix: unknown option 'bad'")
        seen.append(dict(options))
        return NoDecider()

    monkeypatch.setitem(registry.REGISTRY, "prefix", factory)
    assert (build_settings(MIN).decider, build_settings(MIN).decider_options) == ("none", {})
    s = build_settings(MIN, {"decider": {"name": "prefix", "min_tokens": 64}})
    assert (s.decider, dict(s.decider_options)) == ("prefix", {"min_tokens": 64})
    assert seen[-1] == {"min_tokens": 64}, "the factory saw the options at startup"
    # a later bare name (the --decider flag) naming the same decider keeps the file's options; another drops them
    same = build_settings(MIN, {"decider": {"name": "prefix", "min_tokens": 64}}, {"decider": "prefix"})
    assert dict(same.decider_options) == {"min_tokens": 64}
    other = build_settings(MIN, {"decider": {"name": "prefix", "min_tokens": 64}}, {"decider": "none"})
    assert (other.decider, dict(other.decider_options)) == ("none", {})
    assert build_settings(MIN, from_env({"KVPUSH_DECIDER": "prefix"})).decider == "prefix"
    with pytest.raises(ConfigError, match="unknown option 'bad'"):
        build_settings(MIN, {"decider": {"name": "prefix", "bad": 1}})


def test_workers_are_built_from_typed_fields() -> None:
    spec = prefill_from_mapping(
        {"url": "https://p:8100/", "engine_id": "p0", "side_port": 5600, "side_host": "10.0.0.9"}, where="admin"
    )
    assert spec == WorkerSpec("https://p:8100", Role.PREFILL, NixlIdentity("p0", "10.0.0.9", 5600))
    assert prefill_from_mapping({"url": "http://p:1"}, where="admin").identity is None
    assert decode_from_mapping({"url": "https://d:1"}, where="admin") == WorkerSpec("https://d:1", Role.DECODE)
    known = r"known: \['dp', 'pp', 'tp', 'url'\]"
    with pytest.raises(ConfigError, match=r"admin: unknown option\(s\) \['engine_id'\]; " + known):
        decode_from_mapping({"url": "http://d:1", "engine_id": "x"}, where="admin")
    with pytest.raises(ConfigError, match="side_host: expected a non-empty string"):
        prefill_from_mapping({"url": "http://p:1", "engine_id": "e", "side_port": 1, "side_host": 7}, where="admin")
    # a field value is never read as more fields (the admin API once joined fields into a SPEC string)
    spec = prefill_from_mapping({"url": "http://p:1", "engine_id": "e,side_host=evil", "side_port": 1}, where="a")
    assert spec.identity is not None and (spec.identity.engine_id, spec.identity.host) == ("e,side_host=evil", "p")


@pytest.mark.parametrize(
    "make",
    [
        lambda: parse_prefill_spec("http://u:secret@p:1"),
        lambda: parse_decode_url("http://u:secret@d:1"),
        lambda: build_settings({"prefill": ["http://p:1"], "decode": ["http://u:secret@d:1"]}),
        lambda: build_settings({"prefill": [{"url": "http://u:secret@p:1"}], "decode": ["http://d:1"]}),
        lambda: build_settings({"prefill": ["http://p:1"], "decode": [{"url": "https://secret@d:1"}]}),
        lambda: prefill_from_mapping({"url": "http://u:secret@p:1", "engine_id": "e", "side_port": 1}, where="admin"),
        lambda: decode_from_mapping({"url": "http://u:secret@d:1"}, where="admin"),
        lambda: build_settings(MIN, {"decode": [], "discovery": {"decode": {"static": ["http://u:secret@d:1"]}}}),
    ],
)
def test_credentials_in_a_worker_url_are_refused_everywhere_and_never_shown(make: Any) -> None:
    with pytest.raises(ConfigError, match="must not carry credentials") as refused:
        make()
    assert "secret" not in str(refused.value)


def test_the_discovery_block_is_parsed_once_into_typed_settings() -> None:
    s = build_settings({"prefill": ["http://p:1"], "discovery": {"decode": {"dns": {"name": "d.example", "port": 1}}}})
    assert isinstance(s.discovery, Discovery) and "decode" in s.discovery and "prefill" not in s.discovery
    (source,) = s.discovery
    assert isinstance(source, DnsConfig) and source.name == "d.example"
    with pytest.raises(ConfigError, match=r"discovery\.decode\.dns\.interval"):
        build_settings(
            {"prefill": ["http://p:1"], "discovery": {"decode": {"dns": {"name": "d", "port": 1, "interval": 0}}}}
        )


def test_the_environment_resolves_in_cluster_defaults_at_startup(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("llm\n")
    kube = {"selector": "a=b", "port": 8000, "token_path": str(tmp_path / "token"), "insecure": True}
    s = build_settings({"prefill": ["http://p:1"], "discovery": {"decode": {"kubernetes": kube}}})
    (unresolved,) = s.discovery
    assert isinstance(unresolved, KubernetesConfig) and unresolved.api_url is None, "build_settings reads no env"
    (resolved,) = with_environment(s, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}).discovery
    assert isinstance(resolved, KubernetesConfig)
    assert (resolved.api_url, resolved.namespace) == ("https://10.96.0.1:443", "llm")
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        with_environment(s, {})


def test_policies_take_their_options_from_the_policy_block() -> None:
    block = {"policy": {"decode": {"name": "load-aware", "kv_weight": 10}, "prefill": "round-robin"}}
    s = build_settings(MIN, block)
    assert (s.decode_policy, dict(s.decode_policy_options)) == ("load-aware", {"kv_weight": 10})
    assert (s.prefill_policy, dict(s.prefill_policy_options)) == ("round-robin", {})
    flag = build_settings(MIN, block, {"decode_policy": "load-aware"})  # --decode-policy naming the same policy
    assert dict(flag.decode_policy_options) == {"kv_weight": 10}
    other = build_settings(MIN, block, {"decode_policy": "least-loaded"})
    assert (other.decode_policy, dict(other.decode_policy_options)) == ("least-loaded", {})
    assert (build_settings(MIN).decode_policy, build_settings(MIN).prefill_policy) == (
        "least-loaded",
        "least-prefill-tokens",
    )


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (
            {"policy": {"decode": {"name": "load-aware", "running_weight": 1}}},
            r"unknown option\(s\) \['running_weight'\]",
        ),
        ({"policy": {"decode": {"name": "least-loaded", "kv_weight": 1}}}, "it takes no options"),
        ({"policy": {"decode": {"kv_weight": 1}}}, r"policy\.decode: expected a name or a mapping with name"),
        ({"policy": {"encode": "round-robin"}}, r"policy: unknown role\(s\) \['encode'\]"),
        ({"policy": "round-robin"}, "policy: expected a mapping of role"),
        ({"policy": {"prefill": "fastest"}}, "unknown selection policy 'fastest'"),
    ],
)
def test_bad_policy_settings_are_refused_at_startup(layer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_settings(MIN, layer)


@pytest.mark.parametrize("key", ["leg_client", "server"])
def test_the_deleted_leg_client_and_server_settings_are_refused_by_name(key: str) -> None:
    """Both lost their measurement and were deleted (bench/ANALYSIS.md): a file that still sets one is told so."""
    with pytest.raises(ConfigError, match=f"unknown setting '{key}'"):
        build_settings(MIN, {key: "http1" if key == "leg_client" else "uvicorn"})
    assert not hasattr(build_settings(MIN), key)


def test_the_deleted_leg_client_and_server_flags_are_refused() -> None:
    for flag, value in (("--leg-client", "http1"), ("--server", "uvicorn")):
        with pytest.raises(SystemExit):
            load_serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2", flag, value], {})


def test_dp_declares_a_server_s_data_parallel_ranks() -> None:
    from router.workers.specs import parse_decode_url, parse_prefill_spec

    spec = parse_prefill_spec("http://p:8100,engine_id=p0,side_port=5600,dp=2")
    assert spec.dp_size == 2 and spec.identity is not None and spec.identity.engine_id == "p0"
    assert parse_prefill_spec("http://p:8100,dp=4").dp_size == 4
    assert parse_prefill_spec("http://p:8100").dp_size == 1
    assert parse_decode_url("http://d:8200,dp=2").dp_size == 2
    assert build_settings({"prefill": ["http://p:1,dp=2"], "decode": ["http://d:1,dp=3"]}).decode[0].dp_size == 3
    for bad in ("http://p:8100,dp=0", "http://p:8100,dp=x", "http://p:8100,dp=1025"):
        with pytest.raises(ConfigError, match="dp"):
            parse_prefill_spec(bad)
    with pytest.raises(ConfigError, match="already names a data-parallel rank"):
        parse_prefill_spec("http://p:8100,engine_id=p0_dp1,side_port=5600,dp=2")
    with pytest.raises(ConfigError, match="known"):
        parse_decode_url("http://d:8200,engine_id=d0")
