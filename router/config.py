"""Router settings: defaults, a YAML file, environment and flags merged (flags win), then validated. Pure, except
`with_environment`, which resolves what only the running process knows (Kubernetes in-cluster defaults).

Where things live: the value checks (one rule per kind of value) in router/values.py, the worker specs (SPEC
strings, typed fields) in router/workers/specs.py, the `discovery:` block in router/discovery/settings.py, each policy's
and decider's options in its own factory (router/policy.py, router/deciders/registry.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from router import values
from router.deciders import registry as deciders
from router.discovery.settings import Discovery, parse_discovery, resolve_in_cluster
from router.domain import Fallback, Mode, Role, WorkerSpec
from router.errors import ConfigError
from router.gateway import GatewaySettings, parse_gateway
from router.kv_events.settings import KvEventSettings, parse_kv_events
from router.policy import make_policy
from router.tracing.settings import TracingSettings, parse_tracing
from router.tracing.settings import merge as merge_tracing
from router.workers.specs import (
    decode_from_mapping,
    parse_decode_url,
    parse_prefill_spec,
    prefill_from_mapping,
    workers,
)

__all__ = [  # the worker builders live in router.workers.specs; config is where callers find every setting
    "Limits",
    "Settings",
    "Timeouts",
    "build_settings",
    "decode_from_mapping",
    "from_env",
    "parse_decode_url",
    "parse_prefill_spec",
    "prefill_from_mapping",
    "with_environment",
]


# connector.rendezvous.actions.Timeouts is the same concept in the other process (tests/unit/test_layout_names.py)
@dataclass(frozen=True)
class Timeouts:
    """Every upstream deadline, in seconds. None of them may be unset."""

    connect: float = 5.0  # TCP connect to a worker
    prefill: float = 300.0  # whole prefill leg, request to JSON answer
    decode_first_byte: float = 120.0  # decode leg to its first body byte (well under vLLM's 480 s watchdog)
    decode_total: float = 900.0  # a non-streamed decode leg, request to whole answer
    stream_idle: float = 120.0  # longest silence between two events of a decode stream
    health: float = 1.0  # one health probe (a timed-out probe is confirmed by a second at once; see health_interval)
    client_body: float = 10.0  # the whole client request body must arrive within this (else 408)
    client_write_stall: float = 30.0  # a streaming client that accepts no bytes this long: stream and legs closed
    helper: float = 30.0  # one /tokenize, /detokenize or /version call passed to a worker (router/passthrough.py)


@dataclass(frozen=True)
class Limits:
    """What one client request may hold. Beyond them the request is refused (status in each comment)."""

    max_body_bytes: int = 16 * 2**20  # 413
    max_header_bytes: int = 32 * 2**10  # the sum of header names and values; 431
    max_headers: int = 100  # 431
    max_request_id_chars: int = 128  # a longer x-request-id, or one outside [A-Za-z0-9._:-], is replaced
    max_event_bytes: int = 8 * 2**20  # one upstream SSE event; larger: the leg fails (502-class)
    max_json_depth: int = 64  # nesting of the client's JSON body; 400
    max_n: int = 16  # choices one request may ask for ('n'); 400
    max_batch_prompts: int = 64  # prompts in one batched /v1/completions request; 400


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: Mode = Mode.PUSH
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    decode_policy: str = "least-loaded"  # a name in router.policy.REGISTRY
    prefill_policy: str = "least-prefill-tokens"
    decode_policy_options: Mapping[str, Any] = field(default_factory=dict)  # the policy's own settings
    prefill_policy_options: Mapping[str, Any] = field(default_factory=dict)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    # A round of probes every second, each with a 1 s deadline, two timeouts in a row to go down: a hung worker
    # (SIGSTOP: the kernel still accepts connections, nothing answers) is down within 1 + 2 x 1 = 3 s, and its legs
    # in flight are told (Pool.track). vLLM answers /health from its API process without the engine, so a busy
    # engine answers at once; one slow answer (a starved API process) is not enough to take a worker down.
    health_interval: float = 1.0
    retries: int = 1  # extra attempts with fresh ids when nothing was sent to the client yet
    fallback: Fallback = Fallback.NONE  # DECODE_ONLY: with no healthy prefill, decode computes the prompt itself
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
    discovery: Discovery = field(default_factory=Discovery)  # per role: a static, DNS or Kubernetes source
    scrape_interval: float = 0.0  # seconds between scrapes of workers' /metrics; 0: off
    timings_capacity: int = 4096  # requests kept for GET /debug/timings
    log_level: str = "info"
    log_format: str = "json"  # "json" (one object per line) or "text"
    decider: str = "none"  # the P/D decider (router.deciders.registry.REGISTRY); "none": the mode, policies pick
    decider_options: Mapping[str, Any] = field(default_factory=dict)  # the decider's own settings
    gateway: GatewaySettings = field(default_factory=GatewaySettings)  # behind an InferencePool's EPP (gateway.py)
    tracing: TracingSettings = field(default_factory=TracingSettings)  # OpenTelemetry (router/tracing/settings.py)
    kv_events: KvEventSettings = field(default_factory=KvEventSettings)  # the engines' KV events (router/kv_events)


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
    "KVPUSH_DECIDER": "decider",
    "KVPUSH_TRACING": "tracing",  # true/false: tracing.enabled (the rest from OTEL_* variables)
    "KVPUSH_DRAIN_DELAY": "drain_delay",  # seconds; 0: the listener closes at once on SIGTERM
}
_TIMEOUT_NAMES = {f.name for f in fields(Timeouts)}
_LIMIT_NAMES = {f.name for f in fields(Limits)}
_NAMED = ("decider", "decode_policy", "prefill_policy")  # a name, or a mapping {name: ..., <its options>}
_BLOCKS = {"timeouts", "limits", "kv_events"}  # mappings merged name by name over the layers
_TOP_NAMES = {f.name for f in fields(Settings)} - _BLOCKS - {f"{n}_options" for n in _NAMED}


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


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings named by KVPUSH_* variables, as raw values."""
    return {name: env[var] for var, name in _ENV.items() if env.get(var)}


def with_environment(settings: Settings, env: Mapping[str, str]) -> Settings:
    """`settings` with what only the running process can know resolved: the Kubernetes in-cluster defaults of the
    discovery sources (API server from KUBERNETES_SERVICE_HOST/PORT, namespace and CA of the service account).
    Call it at startup, before serving, so a missing one is a configuration error rather than a failing loop;
    `build_settings` stays free of the environment so a deployment's config can be checked outside its cluster."""
    return replace(settings, discovery=resolve_in_cluster(settings.discovery, env))


def build_settings(*layers: Mapping[str, Any]) -> Settings:
    """Merge raw layers (later wins; None values are skipped) over the defaults, then validate."""
    raw: dict[str, Any] = {}
    blocks: dict[str, dict[str, Any]] = {"timeouts": {}, "limits": {}, "kv_events": {}}
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                continue
            if key in blocks:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{key}: expected a mapping of name → value")
                blocks[key].update(value)
            elif key == "policy":
                for role, choice in _policy_block(value).items():
                    raw[f"{role}_policy"] = _merge_named(raw.get(f"{role}_policy"), choice)
            elif key in _NAMED:
                raw[key] = _merge_named(raw.get(key), value)
            elif key == "tracing":
                raw[key] = merge_tracing(raw.get(key), value)
            elif key in _TOP_NAMES:
                raw[key] = value
            else:
                known = sorted(_TOP_NAMES | {*blocks, "policy"})
                raise ConfigError(f"unknown setting {key!r}; known: {known}")
    settings = _validate(raw, blocks["timeouts"], blocks["limits"])
    return replace(settings, kv_events=parse_kv_events(blocks["kv_events"] or None))


def _policy_block(value: Any) -> Mapping[str, Any]:
    """`policy: {decode: NAME | {name: NAME, <options>}, prefill: ...}`."""
    if not isinstance(value, Mapping):
        raise ConfigError("policy: expected a mapping of role → policy name (or {name: ..., <options>})")
    unknown = set(value) - {str(r) for r in Role}
    if unknown:
        raise ConfigError(f"policy: unknown role(s) {sorted(map(str, unknown))}; known: prefill, decode")
    return value


def _merge_named(earlier: Any, value: Any) -> Any:
    """A later choice replaces an earlier one; a bare name naming the same thing keeps the earlier options (a flag
    naming the policy or decider the file configures)."""
    if isinstance(earlier, Mapping) and isinstance(value, str) and earlier.get("name") == value:
        return earlier
    return value


def _named(value: Any, where: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `{name: NAME, <options>}` → (name, options)."""
    if isinstance(value, Mapping):
        name, options = value.get("name"), {str(k): v for k, v in value.items() if k != "name"}
    else:
        name, options = value, {}
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: expected a name or a mapping with name and its options")
    return name, options


def _decider(value: Any) -> tuple[str, dict[str, Any]]:
    """The decider and its options, checked by the decider's own factory."""
    name, options = _named(value, "decider")
    if name not in deciders.REGISTRY:
        known = ", ".join(sorted(deciders.REGISTRY))
        raise ConfigError(f"decider: unknown decider {name!r}; known deciders: {known}")
    deciders.make_decider(name, options)  # its factory refuses bad options with a ConfigError
    return name, options


def _policy(value: Any, role: Role) -> tuple[str, dict[str, Any]]:
    """One role's selection policy and its options, checked by the policy's factory."""
    name, options = _named(value, f"policy.{role}")
    make_policy(name, options)  # refuses an unknown name or option with a ConfigError
    return name, options


def _limits(raw: Mapping[str, Any]) -> Limits:
    unknown = set(raw) - _LIMIT_NAMES
    if unknown:
        raise ConfigError(f"limits: unknown name(s) {sorted(map(str, unknown))}; known: {sorted(_LIMIT_NAMES)}")
    return replace(Limits(), **{k: values.integer(v, f"limits.{k}", low=1) for k, v in raw.items()})


def _fallback(value: Any) -> Fallback:
    try:
        return Fallback(str(value).lower())
    except ValueError:
        raise ConfigError(f"fallback: expected 'none' or 'decode-only', got {value!r}") from None


def _validate(raw: dict[str, Any], timeouts_raw: dict[str, Any], limits_raw: dict[str, Any]) -> Settings:
    unknown = set(timeouts_raw) - _TIMEOUT_NAMES
    if unknown:
        raise ConfigError(f"timeouts: unknown name(s) {sorted(unknown)}; known: {sorted(_TIMEOUT_NAMES)}")
    timeouts = replace(Timeouts(), **{k: values.seconds(v, f"timeouts.{k}") for k, v in timeouts_raw.items()})
    try:
        mode = Mode(str(raw.get("mode", Mode.PUSH)).lower())
    except ValueError:
        raise ConfigError(f"mode: expected 'push' or 'pull', got {raw.get('mode')!r}") from None
    decider_name, decider_options = _decider(raw.get("decider", Settings.decider))
    decode_policy, decode_options = _policy(raw.get("decode_policy", Settings.decode_policy), Role.DECODE)
    prefill_policy, prefill_options = _policy(raw.get("prefill_policy", Settings.prefill_policy), Role.PREFILL)

    def get(name: str) -> Any:
        return raw.get(name, getattr(Settings, name))

    def secs(name: str, *, zero_off: bool = False) -> float:
        return values.seconds(get(name), name, zero_off=zero_off)

    def count(name: str, low: int, high: int | None = None) -> int:
        return values.integer(get(name), name, low=low, high=high)

    settings = Settings(
        host=str(get("host")),
        port=values.port(get("port"), "port", zero_ok=True),
        mode=mode,
        prefill=workers(raw.get("prefill", ()), Role.PREFILL),
        decode=workers(raw.get("decode", ()), Role.DECODE),
        decode_policy=decode_policy,
        prefill_policy=prefill_policy,
        decode_policy_options=decode_options,
        prefill_policy_options=prefill_options,
        timeouts=timeouts,
        limits=_limits(limits_raw),
        health_interval=secs("health_interval"),
        retries=count("retries", 0, 5),
        fallback=_fallback(get("fallback")),
        max_connections=count("max_connections", 1),
        max_in_flight=count("max_in_flight", 1),
        admission_queue=count("admission_queue", 0),
        admission_wait=secs("admission_wait"),
        eject_after=count("eject_after", 1),
        eject_backoff=secs("eject_backoff"),
        eject_backoff_max=secs("eject_backoff_max"),
        drain_delay=secs("drain_delay", zero_off=True),
        drain_grace=secs("drain_grace"),
        api_keys=_keys(raw.get("api_keys", ())),
        admin_key=_key(raw.get("admin_key"), "admin_key"),
        discovery=parse_discovery(raw.get("discovery", {})),
        tracing=parse_tracing(raw.get("tracing")),
        scrape_interval=secs("scrape_interval", zero_off=True),
        timings_capacity=count("timings_capacity", 0),
        log_level=str(get("log_level")).lower(),
        log_format=str(get("log_format")).lower(),
        decider=decider_name,
        decider_options=decider_options,
        gateway=parse_gateway(raw.get("gateway", {})),
    )
    for role, members in (("prefill", settings.prefill), ("decode", settings.decode)):
        if not members and role not in settings.discovery:
            hint = "--prefill URL[,engine_id=..,side_port=..]" if role == "prefill" else "--decode URL"
            raise ConfigError(f"no {role} workers: give at least one ({hint}) or a discovery source for {role}")
    if settings.log_format not in ("json", "text"):
        raise ConfigError(f"log_format: expected 'json' or 'text', got {settings.log_format!r}")
    if settings.admin_key is not None and settings.admin_key in settings.api_keys:
        raise ConfigError("admin_key must differ from every client API key")
    overlap = {w.url for w in settings.prefill} & {w.url for w in settings.decode}
    if overlap:
        raise ConfigError(f"a worker cannot be both prefill and decode: {sorted(overlap)}")
    if settings.log_level not in ("critical", "error", "warning", "info", "debug"):
        raise ConfigError(f"log_level: unknown level {settings.log_level!r}")
    return settings
