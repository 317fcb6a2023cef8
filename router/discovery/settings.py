"""Discovery settings: the `discovery:` block parsed into one typed config per role, validated. Pure."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router import values
from router.config import parse_prefill_spec
from router.domain import Role, WorkerSpec
from router.errors import ConfigError

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class StaticConfig:
    role: Role
    workers: tuple[WorkerSpec, ...]


@dataclass(frozen=True)
class DnsConfig:
    """A (headless) service name whose A/AAAA records are the workers, re-resolved every `interval` s."""

    role: Role
    name: str
    port: int
    interval: float = 5.0
    timeout: float = 2.0  # one resolution, both record types
    nameserver: str | None = None  # an IP address; None: the system resolver
    nameserver_port: int = 53


@dataclass(frozen=True)
class KubernetesConfig:
    """Ready pods matching `selector` in `namespace`, listed then watched through the Kubernetes API."""

    role: Role
    selector: str
    port: int  # used unless the pod's kvpush.io/port annotation says otherwise
    namespace: str | None = None  # None: the service account's namespace
    api_url: str | None = None  # None: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token: str | None = None  # None: read from token_path before every call (tokens rotate)
    token_path: str = f"{SERVICE_ACCOUNT}/token"
    ca_path: str | None = f"{SERVICE_ACCOUNT}/ca.crt"
    insecure: bool = False  # skip TLS verification (tests only)
    watch_timeout: int = 240  # the server ends each watch after this many seconds; we then watch again
    request_timeout: float = 10.0  # every other call (LIST), whole
    backoff_max: float = 30.0  # longest wait between failed attempts


SourceConfig = StaticConfig | DnsConfig | KubernetesConfig

_KINDS = ("static", "dns", "kubernetes")
_DNS_KEYS = {"name", "port", "interval", "timeout", "nameserver"}
_KUBE_KEYS = {
    "namespace",
    "selector",
    "port",
    "api_url",
    "token",
    "token_path",
    "ca_path",
    "insecure",
    "watch_timeout",
    "request_timeout",
    "backoff_max",
}


def parse_discovery(raw: Mapping[str, Any]) -> list[SourceConfig]:
    """The value of the `discovery:` block: role → {dns: {...}} | {kubernetes: {...}} | {static: [URL, ...]}.
    A role left out has no discovery (its workers come from the static settings)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"discovery: expected a mapping of role → source, got {type(raw).__name__}")
    unknown = set(raw) - {str(r) for r in Role}
    if unknown:
        raise ConfigError(f"discovery: unknown role(s) {sorted(map(str, unknown))}; known: prefill, decode")
    return [_source(Role(name), raw[name]) for name in (str(r) for r in Role) if name in raw]


def _source(role: Role, block: Any) -> SourceConfig:
    where = f"discovery.{role}"
    if not isinstance(block, Mapping) or len(block) != 1 or next(iter(block)) not in _KINDS:
        got = f"keys {sorted(map(str, block))}" if isinstance(block, Mapping) else type(block).__name__
        raise ConfigError(f"{where}: expected exactly one of {', '.join(_KINDS)}, got {got}")
    kind, options = next(iter(block.items()))
    where = f"{where}.{kind}"
    if kind == "static":
        return _static(role, options, where)
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}: expected a mapping of options, got {type(options).__name__}")
    known = _DNS_KEYS if kind == "dns" else _KUBE_KEYS
    extra = set(options) - known
    if extra:
        raise ConfigError(f"{where}: unknown option(s) {sorted(map(str, extra))}; known: {sorted(known)}")
    return _dns(role, options, where) if kind == "dns" else _kubernetes(role, options, where)


def _static(role: Role, items: Any, where: str) -> StaticConfig:
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{where}: expected a list of worker URLs")
    specs = tuple(parse_prefill_spec(i) if role is Role.PREFILL else WorkerSpec(_url(i, where), role) for i in items)
    return StaticConfig(role=role, workers=specs)


def _dns(role: Role, o: Mapping[str, Any], where: str) -> DnsConfig:
    name = o.get("name")
    if not isinstance(name, str) or not name.strip(". "):
        raise ConfigError(f"{where}: name (the service's DNS name) is missing")
    host, port = _nameserver(o["nameserver"], where) if o.get("nameserver") else (None, 53)
    return DnsConfig(
        role=role,
        name=name.strip(),
        port=_port(o.get("port"), f"{where}.port"),
        interval=_seconds(o.get("interval", DnsConfig.interval), f"{where}.interval"),
        timeout=_seconds(o.get("timeout", DnsConfig.timeout), f"{where}.timeout"),
        nameserver=host,
        nameserver_port=port,
    )


def _kubernetes(role: Role, o: Mapping[str, Any], where: str) -> KubernetesConfig:
    selector = o.get("selector")
    if not isinstance(selector, str) or not selector.strip():
        raise ConfigError(f"{where}: selector (a label selector such as 'app=vllm,role=decode') is missing")
    api_url = o.get("api_url")
    if api_url is not None:
        api_url = _url(api_url, f"{where}.api_url", https_too=True)
    ca_path = o.get("ca_path", KubernetesConfig.ca_path)
    return KubernetesConfig(
        role=role,
        selector=selector.strip(),
        port=_port(o.get("port"), f"{where}.port"),
        namespace=_text(o.get("namespace"), f"{where}.namespace"),
        api_url=api_url,
        token=_text(o.get("token"), f"{where}.token", secret=True),
        token_path=_text(o.get("token_path"), f"{where}.token_path") or KubernetesConfig.token_path,
        ca_path=None if ca_path is None else _text(ca_path, f"{where}.ca_path"),
        insecure=_bool(o.get("insecure", False), f"{where}.insecure"),
        watch_timeout=math.ceil(
            _seconds(o.get("watch_timeout", KubernetesConfig.watch_timeout), f"{where}.watch_timeout")
        ),
        request_timeout=_seconds(
            o.get("request_timeout", KubernetesConfig.request_timeout), f"{where}.request_timeout"
        ),
        backoff_max=_seconds(o.get("backoff_max", KubernetesConfig.backoff_max), f"{where}.backoff_max"),
    )


def _nameserver(value: Any, where: str) -> tuple[str, int]:
    """`IP`, `IP:PORT`, `[IPv6]:PORT` or a bare IPv6 address."""
    text = str(value).strip()
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise ConfigError(f"{where}.nameserver: {value!r} is not an IP address (optionally with :port)") from None
    return address, _port(port, f"{where}.nameserver port")


def _url(value: Any, where: str, *, https_too: bool = True) -> str:
    return values.url(value, where)


def _port(value: Any, where: str) -> int:
    if value is None:
        raise ConfigError(f"{where}: the workers' port is missing")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a port number, got {value!r}") from None
    if not 1 <= number <= 65535:
        raise ConfigError(f"{where}: {number} is out of range [1, 65535]")
    return number


def _seconds(value: Any, where: str, *, low: float = 0.0) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}") from None
    if not number > low or number == float("inf"):
        raise ConfigError(f"{where}: must be a finite number of seconds above {low:g}, got {value!r}")
    return number


def _text(value: Any, where: str, *, secret: bool = False) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        shown = type(value).__name__ if secret else repr(value)
        raise ConfigError(f"{where}: expected a non-empty string, got {shown}")
    return value.strip()


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value
