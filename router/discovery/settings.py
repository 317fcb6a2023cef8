"""Discovery settings: the `discovery:` block parsed into one typed config per role, validated, and the
Kubernetes in-cluster defaults resolved from the environment. Pure, except `resolve_in_cluster`, which reads the
service account's namespace file and checks that its CA file exists."""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from router import values
from router.discovery.base import host_for_url
from router.domain import Role, WorkerSpec
from router.errors import ConfigError
from router.workers.specs import workers

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


@dataclass(frozen=True)
class Discovery:
    """The `discovery:` block: at most one source per role, in role order. Iterates over its sources;
    `role in discovery` (a Role or its name) says whether that role's membership comes from discovery."""

    sources: tuple[SourceConfig, ...] = ()

    def __iter__(self) -> Iterator[SourceConfig]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def __contains__(self, role: object) -> bool:
        return any(str(source.role) == str(role) for source in self.sources)

    def source(self, role: Role) -> SourceConfig | None:
        return next((s for s in self.sources if s.role is role), None)


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


def parse_discovery(raw: Mapping[str, Any] | Discovery) -> Discovery:
    """The value of the `discovery:` block: role → {dns: {...}} | {kubernetes: {...}} | {static: [worker, ...]}.
    A role left out has no discovery (its workers come from the static settings). An already parsed block
    (`Settings.discovery`) is returned as it is."""
    if isinstance(raw, Discovery):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"discovery: expected a mapping of role → source, got {type(raw).__name__}")
    unknown = set(raw) - {str(r) for r in Role}
    if unknown:
        raise ConfigError(f"discovery: unknown role(s) {sorted(map(str, unknown))}; known: prefill, decode")
    return Discovery(tuple(_source(Role(name), raw[name]) for name in (str(r) for r in Role) if name in raw))


def resolve_in_cluster(discovery: Discovery, env: Mapping[str, str]) -> Discovery:
    """Every Kubernetes source with its in-cluster defaults filled in: the API server from
    KUBERNETES_SERVICE_HOST/PORT, the namespace from the service account; its CA file must exist. Raises
    ConfigError when one is missing (not in a pod and not given)."""
    return Discovery(tuple(in_cluster(s, env) if isinstance(s, KubernetesConfig) else s for s in discovery))


def in_cluster(cfg: KubernetesConfig, env: Mapping[str, str]) -> KubernetesConfig:
    """`cfg` with api_url and namespace resolved (see resolve_in_cluster)."""
    api_url = cfg.api_url or in_cluster_api_url(env)
    verified = not cfg.insecure and api_url.startswith("https://") and cfg.ca_path is not None
    if verified and cfg.ca_path is not None and not os.path.exists(cfg.ca_path):
        raise ConfigError(f"Kubernetes discovery: CA file {cfg.ca_path} not found; give ca_path (or insecure: true)")
    return replace(cfg, api_url=api_url, namespace=cfg.namespace or _namespace_of(cfg.token_path))


def in_cluster_api_url(env: Mapping[str, str]) -> str:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("Kubernetes discovery: KUBERNETES_SERVICE_HOST is unset (not in a pod?); give api_url")
    return f"https://{host_for_url(host)}:{values.port(port, 'KUBERNETES_SERVICE_PORT')}"


def _namespace_of(token_path: str) -> str:
    path = Path(token_path).parent / "namespace"
    try:
        namespace = path.read_text().strip()
    except OSError:
        raise ConfigError(f"Kubernetes discovery: no namespace given and {path} is unreadable") from None
    if not namespace:
        raise ConfigError(f"Kubernetes discovery: no namespace given and {path} is empty")
    return namespace


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
    if not isinstance(items, list):
        raise ConfigError(f"{where}: expected a list of worker URLs")
    return StaticConfig(role=role, workers=workers(items, role, where=where))


def _dns(role: Role, o: Mapping[str, Any], where: str) -> DnsConfig:
    name = o.get("name")
    if not isinstance(name, str) or not name.strip(". "):
        raise ConfigError(f"{where}: name (the service's DNS name) is missing")
    host, port = _nameserver(o["nameserver"], where) if o.get("nameserver") else (None, 53)
    return DnsConfig(
        role=role,
        name=name.strip(),
        port=values.port(o.get("port"), f"{where}.port"),
        interval=values.seconds(o.get("interval", DnsConfig.interval), f"{where}.interval"),
        timeout=values.seconds(o.get("timeout", DnsConfig.timeout), f"{where}.timeout"),
        nameserver=host,
        nameserver_port=port,
    )


def _kubernetes(role: Role, o: Mapping[str, Any], where: str) -> KubernetesConfig:
    selector = o.get("selector")
    if not isinstance(selector, str) or not selector.strip():
        raise ConfigError(f"{where}: selector (a label selector such as 'app=vllm,role=decode') is missing")
    api_url = o.get("api_url")
    ca_path = o.get("ca_path", KubernetesConfig.ca_path)
    return KubernetesConfig(
        role=role,
        selector=selector.strip(),
        port=values.port(o.get("port"), f"{where}.port"),
        namespace=values.text(o.get("namespace"), f"{where}.namespace"),
        api_url=None if api_url is None else values.url(api_url, f"{where}.api_url"),
        token=values.text(o.get("token"), f"{where}.token", secret=True),
        token_path=values.text(o.get("token_path"), f"{where}.token_path") or KubernetesConfig.token_path,
        ca_path=None if ca_path is None else values.text(ca_path, f"{where}.ca_path"),
        insecure=values.boolean(o.get("insecure", False), f"{where}.insecure"),
        watch_timeout=math.ceil(
            values.seconds(o.get("watch_timeout", KubernetesConfig.watch_timeout), f"{where}.watch_timeout")
        ),
        request_timeout=values.seconds(
            o.get("request_timeout", KubernetesConfig.request_timeout), f"{where}.request_timeout"
        ),
        backoff_max=values.seconds(o.get("backoff_max", KubernetesConfig.backoff_max), f"{where}.backoff_max"),
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
    return address, values.port(port, f"{where}.nameserver port")
