"""router/gateway.py: the EPP's `x-prefiller-host-port` and the session header, parsed and bounded; a prefill named
outside the pool, a malformed value or the header twice is an OpenAI-style 400, decided before any dial."""

from __future__ import annotations

import json

import pytest

from router.domain import Role, WorkerSpec
from router.errors import BadRequest, ConfigError
from router.gateway import (
    MAX_HOST_PORT_CHARS,
    PREFILLER_HEADER,
    GatewayPick,
    GatewaySettings,
    HostPort,
    PrefillHeader,
    member_for,
    parse_gateway,
    parse_host_port,
    read_gateway_headers,
)

POOL = [
    WorkerSpec(url="http://10.0.0.5:8000", role=Role.PREFILL),
    WorkerSpec(url="http://10.0.0.6:8000", role=Role.PREFILL),
    WorkerSpec(url="http://[fd00::7]:8000", role=Role.PREFILL),
    WorkerSpec(url="http://prefill-2.kvpush-prefill.kvpush.svc:8000", role=Role.PREFILL),
    WorkerSpec(url="http://plain-host", role=Role.PREFILL),
]


def raw(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs]


# --- host:port -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("10.0.0.5:8000", HostPort("10.0.0.5", 8000)),
        (" 10.0.0.5:8000 ", HostPort("10.0.0.5", 8000)),
        ("[fd00::7]:8000", HostPort("fd00::7", 8000)),
        ("[FD00:0:0::7]:1", HostPort("fd00::7", 1)),
        ("Prefill-2.KVPUSH-prefill.kvpush.svc.:65535", HostPort("prefill-2.kvpush-prefill.kvpush.svc", 65535)),
        ("localhost:80", HostPort("localhost", 80)),
    ],
)
def test_host_port_parses(value: str, parsed: HostPort) -> None:
    assert parse_host_port(value) == parsed


@pytest.mark.parametrize(
    "value",
    [
        "",
        "10.0.0.5",
        "10.0.0.5:",
        ":8000",
        "10.0.0.5:0",
        "10.0.0.5:65536",
        "10.0.0.5:80a",
        "10.0.0.5:+80",
        "10.0.0.5:123456",
        "fd00::7:8000",  # IPv6 without brackets
        "[fd00::7]",
        "[fd00::7]8000",
        "[not-v6]:8000",
        "10.0.0.5:8000,10.0.0.6:8000",
        "http://10.0.0.5:8000",
        "user@10.0.0.5:8000",
        "-bad.example:80",
        "bad-.example:80",
        "a..b:80",
        "exa mple:80",
        "é.example:80",
        "x" * 64 + ".example:80",
        "a" * (MAX_HOST_PORT_CHARS + 1),
    ],
)
def test_malformed_host_port_is_a_400(value: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_host_port(value)
    assert caught.value.http_status == 400
    assert PREFILLER_HEADER in caught.value.message
    assert len(caught.value.message) < 200  # the value is never echoed unbounded


def test_the_refusal_is_an_openai_style_body() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_host_port("nope")
    body = json.loads(caught.value.to_json())
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == 400


# --- pool membership -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("named", "url"),
    [
        (HostPort("10.0.0.6", 8000), "http://10.0.0.6:8000"),
        (HostPort("fd00::7", 8000), "http://[fd00::7]:8000"),
        (HostPort("prefill-2.kvpush-prefill.kvpush.svc", 8000), "http://prefill-2.kvpush-prefill.kvpush.svc:8000"),
        (HostPort("plain-host", 80), "http://plain-host"),  # the scheme's default port
    ],
)
def test_a_named_member_is_found_by_host_and_port(named: HostPort, url: str) -> None:
    found = member_for(named, POOL)
    assert found is not None and found.url == url


@pytest.mark.parametrize(
    "named",
    [HostPort("10.0.0.5", 8001), HostPort("10.0.0.9", 8000), HostPort("prefill-2", 8000), HostPort("fd00::8", 8000)],
)
def test_anything_else_is_no_member(named: HostPort) -> None:
    assert member_for(named, POOL) is None


def test_https_members_default_to_443() -> None:
    assert member_for(HostPort("p.example", 443), [WorkerSpec("https://p.example", Role.PREFILL)]) is not None


# --- the request's headers -------------------------------------------------------------------------------------


def test_the_named_prefill_and_the_session_are_read() -> None:
    pick = read_gateway_headers(
        raw(("X-Prefiller-Host-Port", "10.0.0.6:8000"), ("x-session-id", " chat-42 "), ("other", "x")), POOL
    )
    assert pick == GatewayPick(prefill=POOL[1], session="chat-42")


def test_without_the_header_the_router_chooses_unless_required() -> None:
    assert read_gateway_headers(raw(), POOL) == GatewayPick(prefill=None, session=None)
    with pytest.raises(BadRequest, match="missing"):
        read_gateway_headers(raw(("x-session-id", "s")), POOL, require_prefill=True)


def test_a_prefill_outside_the_pool_is_a_400_that_does_not_name_the_pool() -> None:
    with pytest.raises(BadRequest, match="not in this router's prefill pool") as caught:
        read_gateway_headers(raw((PREFILLER_HEADER, "169.254.169.254:80")), POOL)
    assert "10.0.0.5" not in caught.value.message


def test_an_empty_pool_refuses_every_named_prefill() -> None:
    with pytest.raises(BadRequest):
        read_gateway_headers(raw((PREFILLER_HEADER, "10.0.0.5:8000")), [])


def test_the_header_twice_is_a_400_even_when_both_are_members() -> None:
    with pytest.raises(BadRequest, match="2 times"):
        read_gateway_headers(raw((PREFILLER_HEADER, "10.0.0.5:8000"), (PREFILLER_HEADER, "10.0.0.5:8000")), POOL)


def test_a_malformed_header_is_a_400_even_when_not_required() -> None:
    with pytest.raises(BadRequest):
        read_gateway_headers(raw((PREFILLER_HEADER, "")), POOL)


@pytest.mark.parametrize("session", ["", "   ", "a b", "x" * 257, "tab\there", "\x7f"])
def test_an_unusable_session_is_ignored_not_refused(session: str) -> None:
    pick = read_gateway_headers(raw(("x-session-id", session)), POOL)
    assert pick.session is None


def test_session_headers_are_tried_in_order_and_the_first_usable_value_wins() -> None:
    headers = raw(("x-session-affinity", "second"), ("x-session-id", " "), ("x-session-id", "first"))
    pick = read_gateway_headers(headers, POOL, session_headers=("X-Session-ID", "x-session-affinity"))
    assert pick.session == "first"
    pick = read_gateway_headers(raw(("x-session-affinity", "second")), POOL, session_headers=("x-session-id",))
    assert pick.session is None


# --- the gateway: setting --------------------------------------------------------------------------------------


def test_the_setting_defaults_to_off() -> None:
    assert parse_gateway({}) == GatewaySettings()
    assert not GatewaySettings().on
    assert parse_gateway({"prefill_header": False}).prefill_header is PrefillHeader.OFF  # YAML's bare off


@pytest.mark.parametrize("mode", list(PrefillHeader))
def test_every_mode_parses(mode: PrefillHeader) -> None:
    settings = parse_gateway({"prefill_header": str(mode).upper(), "session_headers": ["X-Session-ID", "x-b"]})
    assert settings.prefill_header is mode and settings.on is (mode is not PrefillHeader.OFF)
    assert settings.session_headers == ("x-session-id", "x-b")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ([], "expected a mapping"),
        ({"prefill": "on"}, "unknown key"),
        ({"prefill_header": "sometimes"}, "prefill_header"),
        ({"session_headers": []}, "session_headers"),
        ({"session_headers": ["bad header"]}, "session_headers"),
        ({"session_headers": [7]}, "session_headers"),
    ],
)
def test_bad_settings_are_config_errors(value: object, where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        parse_gateway(value)
