"""The tracing block and the OTEL_* variables: off by default, kvpush settings over OTel variables over defaults."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import ConfigError
from router.tracing.settings import (
    GRPC,
    HTTP,
    ExportPlan,
    Sampling,
    TracingSettings,
    merge,
    parse_tracing,
    resolve,
)


def test_off_by_default() -> None:
    assert parse_tracing(None) == TracingSettings()
    assert resolve(TracingSettings(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) is None


def test_on_with_defaults() -> None:
    plan = resolve(parse_tracing(True), {})
    assert plan == ExportPlan("http://localhost:4317", GRPC, Sampling("parentbased_always_on", 1.0), "kvpush-router")


def test_the_otel_variables_fill_what_is_unset() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "edge-router",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    plan = resolve(parse_tracing("true"), env)
    assert plan == ExportPlan(
        "http://collector:4318/v1/traces", HTTP, Sampling("parentbased_traceidratio", 0.25), "edge-router"
    )
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:9999/custom"
    env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "grpc"
    plan = resolve(parse_tracing(True), env)
    assert plan is not None and (plan.endpoint, plan.protocol) == ("http://traces:9999/custom", GRPC)


def test_the_settings_win_over_the_otel_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_TRACES_SAMPLER": "always_off", "OTEL_SERVICE_NAME": "x"}
    raw = {"endpoint": "http://b:4318", "protocol": "http/protobuf", "sample_ratio": 0.01, "service_name": "y"}
    plan = resolve(parse_tracing(raw), env)
    assert plan == ExportPlan("http://b:4318/v1/traces", HTTP, Sampling("parentbased_traceidratio", 0.01), "y")


def test_an_endpoint_or_ratio_implies_enabled_unless_said_otherwise() -> None:
    assert parse_tracing({"endpoint": "http://c:4317"}).enabled
    assert parse_tracing({"sample_ratio": "0.5"}).enabled
    assert not parse_tracing({"endpoint": "http://c:4317", "enabled": False}).enabled


@pytest.mark.parametrize("var", [{"OTEL_SDK_DISABLED": "TRUE"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_otel_switches_turn_it_off(var: dict[str, str]) -> None:
    assert resolve(parse_tracing(True), var) is None


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (7, "true/false or a mapping"),
        ({"enabled": 1}, "tracing.enabled"),
        ({"endpont": "x"}, "unknown name"),
        ({"endpoint": "collector:4317"}, "tracing.endpoint"),
        ({"endpoint": "ftp://c:1"}, "tracing.endpoint"),
        ({"endpoint": "http://u:p@c:1"}, "OTEL_EXPORTER_OTLP_HEADERS"),
        ({"endpoint": "http://c:99999"}, "tracing.endpoint"),
        ({"protocol": "http/json"}, "tracing.protocol"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"sample_ratio": True}, "tracing.sample_ratio"),
        ({"service_name": ""}, "tracing.service_name"),
        ("maybe", "tracing"),
    ],
)
def test_bad_settings_are_refused_by_name(raw: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("/", ".")):
        parse_tracing(raw)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "nowhere"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ],
)
def test_bad_otel_variables_are_refused_by_name(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(parse_tracing(True), env)


def test_a_sampler_without_ratio_keeps_its_default() -> None:
    plan = resolve(parse_tracing(True), {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert plan is not None and plan.sampling == Sampling("always_on", 1.0)


def test_layers_merge_key_by_key() -> None:
    yaml_layer = {"endpoint": "http://c:4317", "sample_ratio": 0.1}
    assert merge(yaml_layer, None) == yaml_layer
    assert merge(yaml_layer, False) == {**yaml_layer, "enabled": False}
    assert merge(True, {"sample_ratio": 1}) == {"enabled": True, "sample_ratio": 1}
    assert merge(yaml_layer, {"sample_ratio": 1}) == {"endpoint": "http://c:4317", "sample_ratio": 1}
    assert merge(None, "true") == "true"
    assert parse_tracing(merge(yaml_layer, "false")).enabled is False
