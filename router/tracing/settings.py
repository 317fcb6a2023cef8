"""Tracing settings: the `tracing:` block (YAML, `KVPUSH_TRACING`, flags) and the OpenTelemetry environment
variables, resolved into what the exporter, sampler and resource are built from. Pure: the environment is passed in.

Off by default. The kvpush settings win over the OTel variables, which win over the defaults:

- `enabled` (`--tracing`/`--no-tracing`, `KVPUSH_TRACING`): default false; `OTEL_SDK_DISABLED=true` or
  `OTEL_TRACES_EXPORTER=none` keep it off even when enabled.
- `endpoint` (`--otlp-traces-endpoint`): else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
  `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces` over HTTP), else the SDK's default (localhost:4317 / 4318).
- `protocol` (`--otlp-traces-protocol`, `grpc` or `http/protobuf`): else `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`,
  else `OTEL_EXPORTER_OTLP_PROTOCOL`, else grpc.
- `sample_ratio` (`--trace-sample-ratio`): else `OTEL_TRACES_SAMPLER` + `OTEL_TRACES_SAMPLER_ARG`, else
  parentbased_always_on.
- `service_name`: else `OTEL_SERVICE_NAME`, else kvpush-router (`OTEL_RESOURCE_ATTRIBUTES` is read too).

`sample_ratio: R` means `parentbased_traceidratio` with R: a request that arrives with a sampled parent is traced,
one without a parent is traced with probability R. Headers, timeouts, compression, TLS and the batch processor
(`OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`) are read by the OpenTelemetry SDK itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router import values
from router.errors import ConfigError

GRPC = "grpc"
HTTP = "http/protobuf"
PROTOCOLS = (GRPC, HTTP)
DEFAULT_SERVICE_NAME = "kvpush-router"
DEFAULT_ENDPOINTS = {GRPC: "http://localhost:4317", HTTP: "http://localhost:4318/v1/traces"}
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
ENV = {"KVPUSH_TRACING": "enabled"}  # kvpush's own variables → keys of the tracing block
_KEYS = ("enabled", "endpoint", "protocol", "sample_ratio", "service_name")


@dataclass(frozen=True)
class TracingSettings:
    """The `tracing:` block as configured (None: fall back to the OTel variables, then the default)."""

    enabled: bool = False
    endpoint: str | None = None
    protocol: str | None = None
    sample_ratio: float | None = None
    service_name: str | None = None


@dataclass(frozen=True)
class Sampling:
    """A sampler by its OTel name (SAMPLERS) and its ratio (used by the *traceidratio ones)."""

    name: str = "parentbased_always_on"
    ratio: float = 1.0


@dataclass(frozen=True)
class ExportPlan:
    """Everything tracing is built from, resolved; `None` from `resolve` when tracing is off."""

    endpoint: str
    protocol: str
    sampling: Sampling
    service_name: str


def parse_tracing(value: Any) -> TracingSettings:
    """`tracing: true|false` or `tracing: {enabled, endpoint, protocol, sample_ratio, service_name}`.

    An endpoint or a ratio given without `enabled` switches tracing on (naming where to send is asking for it)."""
    if value is None:
        return TracingSettings()
    if isinstance(value, bool | str):
        return TracingSettings(enabled=values.boolean(value, "tracing"))
    if not isinstance(value, Mapping):
        raise ConfigError("tracing: expected true/false or a mapping of name → value")
    unknown = set(value) - set(_KEYS)
    if unknown:
        raise ConfigError(f"tracing: unknown name(s) {sorted(map(str, unknown))}; known: {list(_KEYS)}")
    endpoint = value.get("endpoint")
    endpoint = None if endpoint in (None, "") else _endpoint(endpoint, "tracing.endpoint")
    protocol = None if value.get("protocol") in (None, "") else _protocol(value["protocol"], "tracing.protocol")
    ratio = value.get("sample_ratio")
    ratio = None if ratio is None else values.number(ratio, "tracing.sample_ratio", low=0.0, high=1.0)
    implied = endpoint is not None or ratio is not None
    enabled = values.boolean(value["enabled"], "tracing.enabled") if "enabled" in value else implied
    service = values.text(value.get("service_name"), "tracing.service_name")
    return TracingSettings(enabled, endpoint, protocol, ratio, service)


def merge(earlier: Any, later: Any) -> Any:
    """Two raw `tracing:` values of the settings' layers, later wins key by key (`true`/`false` is `enabled`).
    A flag that names an endpoint says `{endpoint: URL, enabled: true}` itself when it means to switch it on."""
    if later is None:
        return earlier
    if isinstance(earlier, bool | str):
        earlier = {"enabled": earlier}
    if isinstance(later, bool | str) and isinstance(earlier, Mapping):
        return {**earlier, "enabled": later}
    if isinstance(later, Mapping) and isinstance(earlier, Mapping):
        return {**earlier, **later}
    return later  # parse_tracing refuses what is neither, with its message


def _endpoint(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected an http(s) URL, got {value!r}")
    text = value.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  # raises ValueError for a bad port
    except ValueError as exc:
        raise ConfigError(f"{where}: {values.shown_url(text)} is not a valid URL ({exc})") from None
    if parts.scheme not in values.SCHEMES or not parts.hostname:
        raise ConfigError(f"{where}: {values.shown_url(text)} is not an http(s)://host[:port][/path] URL")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{where}: credentials go in OTEL_EXPORTER_OTLP_HEADERS, not in the URL")
    return text


def _protocol(value: Any, where: str) -> str:
    name = str(value).strip().lower()
    if not isinstance(value, str) or name not in PROTOCOLS:
        raise ConfigError(f"{where}: expected one of {', '.join(PROTOCOLS)}, got {value!r}")
    return name


def resolve(settings: TracingSettings, env: Mapping[str, str]) -> ExportPlan | None:
    """What to build, or None when tracing is off (not enabled, or disabled through the OTel variables)."""
    if not settings.enabled:
        return None
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    if exporter not in ("", "otlp"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER: the router exports traces over OTLP only, got {exporter!r}")
    protocol = settings.protocol or _env_protocol(env)
    return ExportPlan(
        endpoint=_resolve_endpoint(settings.endpoint, protocol, env),
        protocol=protocol,
        sampling=_sampling(settings.sample_ratio, env),
        service_name=settings.service_name or env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME,
    )


def _env_protocol(env: Mapping[str, str]) -> str:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if env.get(var, "").strip():
            return _protocol(env[var], var)
    return GRPC


def _resolve_endpoint(configured: str | None, protocol: str, env: Mapping[str, str]) -> str:
    """The traces endpoint. Over HTTP a base URL without a path gets OTLP's `/v1/traces`, as OTel's generic
    `OTEL_EXPORTER_OTLP_ENDPOINT` always does; over gRPC the path is not used."""
    if configured is not None:
        return _with_traces_path(configured) if protocol == HTTP else configured
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if specific:
        return _endpoint(specific, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if generic:
        base = _endpoint(generic, "OTEL_EXPORTER_OTLP_ENDPOINT")
        return f"{base.rstrip('/')}/v1/traces" if protocol == HTTP else base
    return DEFAULT_ENDPOINTS[protocol]


def _with_traces_path(url: str) -> str:
    return f"{url.rstrip('/')}/v1/traces" if urlsplit(url).path in ("", "/") else url


def _sampling(ratio: float | None, env: Mapping[str, str]) -> Sampling:
    if ratio is not None:
        return Sampling("parentbased_traceidratio", ratio)
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or Sampling.name
    if name not in SAMPLERS:
        raise ConfigError(f"OTEL_TRACES_SAMPLER: expected one of {', '.join(SAMPLERS)}, got {name!r}")
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not name.endswith("traceidratio") or not arg:
        return Sampling(name)
    return Sampling(name, values.number(arg, "OTEL_TRACES_SAMPLER_ARG", low=0.0, high=1.0))
