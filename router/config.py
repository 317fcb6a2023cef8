"""Router settings: defaults, a YAML file, environment and flags merged (flags win), then validated. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from router.domain import Mode, NixlIdentity, Role, WorkerSpec
from router.errors import ConfigError
from router.policy import REGISTRY


@dataclass(frozen=True)
class Timeouts:
    """Every upstream deadline, in seconds. None of them may be unset."""

    connect: float = 5.0  # TCP connect to a worker
    prefill: float = 300.0  # whole prefill leg, request to JSON answer
    decode_first_byte: float = 120.0  # decode leg to its first body byte (well under vLLM's 480 s watchdog)
    decode_total: float = 900.0  # a non-streamed decode leg, request to whole answer
    stream_idle: float = 120.0  # longest silence between two events of a decode stream
    health: float = 2.0  # one health probe


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: Mode = Mode.PUSH
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    decode_policy: str = "least-loaded"
    prefill_policy: str = "least-prefill-tokens"
    timeouts: Timeouts = field(default_factory=Timeouts)
    health_interval: float = 2.0
    retries: int = 1  # extra attempts with fresh ids when nothing was sent to the client yet
    fallback: str = "none"  # "decode-only": with no healthy prefill, decode computes the prompt itself
    max_connections: int = 1024
    max_in_flight: int = 512  # admission: client requests in flight at once
    admission_queue: int = 64  # admission: requests that may wait for a slot; beyond it, 429
    admission_wait: float = 5.0  # admission: longest wait for a slot
    eject_after: int = 3  # passive health: soft failures in a row before a worker is ejected
    eject_backoff: float = 1.0  # passive health: first ejection's hold, doubled per ejection
    eject_backoff_max: float = 30.0
    drain_delay: float = 3.0  # on SIGTERM: /ready is 503 this long before the listener closes
    drain_grace: float = 30.0  # on SIGTERM: how long requests in flight may still run
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # client Bearer keys; empty: no auth
    admin_key: str | None = field(default=None, repr=False)  # Bearer key of /admin/*; None: admin API off
    discovery: dict[str, Any] = field(default_factory=dict)  # per role: dns/kubernetes source settings
    scrape_interval: float = 0.0  # seconds between scrapes of workers' /metrics; 0: off
    timings_capacity: int = 4096  # requests kept for GET /debug/timings
    log_level: str = "info"
    log_format: str = "json"  # "json" (one object per line) or "text"


_ENV = {  # environment variable → setting
    "KVPUSH_HOST": "host",
    "KVPUSH_PORT": "port",
    "KVPUSH_MODE": "mode",
    "KVPUSH_PREFILL": "prefill",
    "KVPUSH_DECODE": "decode",
    "KVPUSH_DECODE_POLICY": "decode_policy",
    "KVPUSH_PREFILL_POLICY": "prefill_policy",
    "KVPUSH_LOG_LEVEL": "log_level",
    "KVPUSH_LOG_FORMAT": "log_format",
    "KVPUSH_FALLBACK": "fallback",
    "KVPUSH_API_KEYS": "api_keys",
    "KVPUSH_ADMIN_KEY": "admin_key",
}
_TIMEOUT_NAMES = {f.name for f in fields(Timeouts)}
_TOP_NAMES = {f.name for f in fields(Settings)} - {"timeouts"}


def parse_prefill_spec(spec: str) -> WorkerSpec:
    """`URL` (identity learned from the worker) or `URL,engine_id=ID,side_host=H,side_port=P,tp=1,pp=1`."""
    url, *pairs = [part.strip() for part in spec.split(",")]
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise ConfigError(f"prefill worker {spec!r}: expected key=value after the URL, got {pair!r}")
        options[key] = value
    return _prefill_from_mapping({"url": url, **options}, where=f"prefill worker {spec!r}")


def parse_decode_url(url: str) -> WorkerSpec:
    return WorkerSpec(url=_url(url, f"decode worker {url!r}"), role=Role.DECODE)


def _prefill_from_mapping(item: Mapping[str, Any], *, where: str) -> WorkerSpec:
    known = {"url", "engine_id", "side_host", "side_port", "tp", "pp"}
    unknown = set(item) - known
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    url = _url(item.get("url"), where)
    engine_id = item.get("engine_id")
    if engine_id in (None, "", "auto"):
        if "side_port" in item:
            raise ConfigError(f"{where}: side_port is given but engine_id is not; give both or neither (auto)")
        return WorkerSpec(url=url, role=Role.PREFILL)
    if "side_port" not in item:
        raise ConfigError(f"{where}: engine_id is given but side_port (the NIXL side-channel port) is not")
    identity = NixlIdentity(
        engine_id=str(engine_id),
        host=str(item.get("side_host") or urlsplit(url).hostname),
        port=_int(item["side_port"], f"{where}: side_port", low=1, high=65535),
        tp_size=_int(item.get("tp", 1), f"{where}: tp", low=1),
        pp_size=_int(item.get("pp", 1), f"{where}: pp", low=1),
    )
    return WorkerSpec(url=url, role=Role.PREFILL, identity=identity)


def _workers(value: Any, role: Role) -> tuple[WorkerSpec, ...]:
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{role} workers: expected a list, got {type(value).__name__}")
    out: list[WorkerSpec] = []
    for i, item in enumerate(items):
        where = f"{role} worker #{i + 1}"
        if isinstance(item, WorkerSpec):
            out.append(item)
        elif role is Role.PREFILL and isinstance(item, str):
            out.append(parse_prefill_spec(item))
        elif role is Role.PREFILL and isinstance(item, Mapping):
            out.append(_prefill_from_mapping(item, where=where))
        elif isinstance(item, str):
            out.append(WorkerSpec(url=_url(item, where), role=role))
        elif isinstance(item, Mapping) and set(item) == {"url"}:
            out.append(WorkerSpec(url=_url(item["url"], where), role=role))
        else:
            raise ConfigError(f"{where}: expected a URL string or a mapping with url, got {item!r}")
    urls = [w.url for w in out]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{role} workers: a URL is listed twice: {urls}")
    return tuple(out)


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: url is missing")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {value!r} is not an http(s) URL with a host")
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"{where}: {value!r} must be a base URL without a path (the router adds /v1/...)")
    return value.rstrip("/")


def _int(value: Any, where: str, *, low: int, high: int | None = None) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if number < low or (high is not None and number > high):
        raise ConfigError(f"{where}: {number} is out of range [{low}, {high or 'inf'}]")
    return number


def _float(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number of seconds, got {value!r}") from None
    if not number > 0:
        raise ConfigError(f"{where}: must be a positive number of seconds, got {value!r}")
    return number


def _seconds(value: Any, where: str) -> float:
    """Like _float, but 0 is allowed (it switches the feature off)."""
    return 0.0 if value in (0, "0", 0.0) else _float(value, where)


def _keys(value: Any) -> tuple[str, ...]:
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(k, str) and len(k) >= 8 for k in items):
        raise ConfigError("api_keys: expected a list of key strings of at least 8 characters")
    return tuple(items)


def _key(value: Any, where: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or len(value) < 8:
        raise ConfigError(f"{where}: expected a key string of at least 8 characters")
    return value


def _discovery(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError("discovery: expected a mapping of role → source settings")
    unknown = set(value) - {"prefill", "decode"}
    if unknown:
        raise ConfigError(f"discovery: unknown role(s) {sorted(unknown)}; expected prefill and/or decode")
    from router.discovery.settings import parse_discovery  # late: that module builds on this one

    parse_discovery(value)  # raises ConfigError with the offending key
    return dict(value)


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings named by KVPUSH_* variables, as raw values."""
    return {name: env[var] for var, name in _ENV.items() if env.get(var)}


def build_settings(*layers: Mapping[str, Any]) -> Settings:
    """Merge raw layers (later wins; None values are skipped) over the defaults, then validate."""
    raw: dict[str, Any] = {}
    timeouts: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                continue
            if key == "timeouts":
                if not isinstance(value, Mapping):
                    raise ConfigError("timeouts: expected a mapping of name → seconds")
                timeouts.update(value)
            elif key == "policy" and isinstance(value, Mapping):
                raw.update({f"{role}_policy": name for role, name in value.items()})
            elif key in _TOP_NAMES:
                raw[key] = value
            else:
                raise ConfigError(f"unknown setting {key!r}; known: {sorted(_TOP_NAMES | {'timeouts', 'policy'})}")
    return _validate(raw, timeouts)


def _validate(raw: dict[str, Any], timeouts_raw: dict[str, Any]) -> Settings:
    unknown = set(timeouts_raw) - _TIMEOUT_NAMES
    if unknown:
        raise ConfigError(f"timeouts: unknown name(s) {sorted(unknown)}; known: {sorted(_TIMEOUT_NAMES)}")
    timeouts = replace(Timeouts(), **{k: _float(v, f"timeouts.{k}") for k, v in timeouts_raw.items()})
    try:
        mode = Mode(str(raw.get("mode", Mode.PUSH)).lower())
    except ValueError:
        raise ConfigError(f"mode: expected 'push' or 'pull', got {raw.get('mode')!r}") from None
    settings = Settings(
        host=str(raw.get("host", Settings.host)),
        port=_int(raw.get("port", Settings.port), "port", low=0, high=65535),
        mode=mode,
        prefill=_workers(raw.get("prefill", ()), Role.PREFILL),
        decode=_workers(raw.get("decode", ()), Role.DECODE),
        decode_policy=str(raw.get("decode_policy", Settings.decode_policy)),
        prefill_policy=str(raw.get("prefill_policy", Settings.prefill_policy)),
        timeouts=timeouts,
        health_interval=_float(raw.get("health_interval", Settings.health_interval), "health_interval"),
        retries=_int(raw.get("retries", Settings.retries), "retries", low=0, high=5),
        fallback=str(raw.get("fallback", Settings.fallback)),
        max_connections=_int(raw.get("max_connections", Settings.max_connections), "max_connections", low=1),
        max_in_flight=_int(raw.get("max_in_flight", Settings.max_in_flight), "max_in_flight", low=1),
        admission_queue=_int(raw.get("admission_queue", Settings.admission_queue), "admission_queue", low=0),
        admission_wait=_float(raw.get("admission_wait", Settings.admission_wait), "admission_wait"),
        eject_after=_int(raw.get("eject_after", Settings.eject_after), "eject_after", low=1),
        eject_backoff=_float(raw.get("eject_backoff", Settings.eject_backoff), "eject_backoff"),
        eject_backoff_max=_float(raw.get("eject_backoff_max", Settings.eject_backoff_max), "eject_backoff_max"),
        drain_delay=_seconds(raw.get("drain_delay", Settings.drain_delay), "drain_delay"),
        drain_grace=_float(raw.get("drain_grace", Settings.drain_grace), "drain_grace"),
        api_keys=_keys(raw.get("api_keys", ())),
        admin_key=_key(raw.get("admin_key"), "admin_key"),
        discovery=_discovery(raw.get("discovery", {})),
        scrape_interval=_seconds(raw.get("scrape_interval", Settings.scrape_interval), "scrape_interval"),
        timings_capacity=_int(raw.get("timings_capacity", Settings.timings_capacity), "timings_capacity", low=0),
        log_level=str(raw.get("log_level", Settings.log_level)).lower(),
        log_format=str(raw.get("log_format", Settings.log_format)).lower(),
    )
    for role, workers in (("prefill", settings.prefill), ("decode", settings.decode)):
        if not workers and role not in settings.discovery:
            hint = "--prefill URL[,engine_id=..,side_port=..]" if role == "prefill" else "--decode URL"
            raise ConfigError(f"no {role} workers: give at least one ({hint}) or a discovery source for {role}")
    if settings.fallback not in ("none", "decode-only"):
        raise ConfigError(f"fallback: expected 'none' or 'decode-only', got {settings.fallback!r}")
    if settings.log_format not in ("json", "text"):
        raise ConfigError(f"log_format: expected 'json' or 'text', got {settings.log_format!r}")
    if settings.admin_key is not None and settings.admin_key in settings.api_keys:
        raise ConfigError("admin_key must differ from every client API key")
    for name in (settings.decode_policy, settings.prefill_policy):
        if name not in REGISTRY:
            raise ConfigError(f"unknown selection policy {name!r}; known policies: {', '.join(sorted(REGISTRY))}")
    overlap = {w.url for w in settings.prefill} & {w.url for w in settings.decode}
    if overlap:
        raise ConfigError(f"a worker cannot be both prefill and decode: {sorted(overlap)}")
    if settings.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise ConfigError(f"log_level: unknown level {settings.log_level!r}")
    return settings
