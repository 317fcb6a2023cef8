"""Worker specs from settings: a prefill SPEC string, a decode URL or typed fields → WorkerSpec, checked. Pure.

Used by the static settings (flags, environment, YAML), discovery's static source and the admin API alike, so a
worker is described and checked one way everywhere. Fields are never joined into a SPEC string and re-parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from router import values
from router.domain import ConnectorKind, NixlIdentity, Role, WorkerSpec
from router.errors import ConfigError
from router.workers.ranks import MAX_DP_SIZE, split_rank


def parse_prefill_spec(spec: str) -> WorkerSpec:
    """`URL` (identity learned from the worker) or `URL,engine_id=ID,side_host=H,side_port=P,tp=1,pp=1`, either
    with `,dp=N` for a server with N data-parallel ranks; `,connector=kvpush` for kvpush's connector (its DP
    ranks' side ports are base + r x TP x PP; default `nixl`: upstream's, base + r)."""
    where = f"prefill worker {values.shown_url(spec)}"
    return prefill_from_mapping(_spec_options(spec, where), where=where)


def parse_decode_url(url: str) -> WorkerSpec:
    """`URL`, or `URL,dp=N` for a server with N data-parallel ranks; `,tp=N` its tensor-parallel size (lets the
    router refuse a prefill it cannot pair with), `,pp=1` (push writes only into PP 1)."""
    where = f"decode worker {values.shown_url(url)}"
    return decode_from_mapping(_spec_options(url, where), where=where)


def _spec_options(spec: str, where: str) -> dict[str, str]:
    url, *pairs = [part.strip() for part in spec.split(",")]
    options: dict[str, str] = {"url": url}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise ConfigError(f"{where}: expected key=value after the URL, got {pair!r}")
        options[key] = value
    return options


_PREFILL_KEYS = {"url", "engine_id", "side_host", "side_port", "tp", "pp", "dp", "connector"}
_DECODE_KEYS = {"url", "dp", "tp", "pp"}


def _dp_size(item: Mapping[str, Any], where: str) -> int:
    return values.integer(item.get("dp", 1), f"{where}: dp", low=1, high=MAX_DP_SIZE)


def prefill_from_mapping(item: Mapping[str, Any], *, where: str) -> WorkerSpec:
    """A prefill worker from typed fields: `url`, and either no identity (learned) or `engine_id` + `side_port`
    (+ optional `side_host`, `tp`, `pp`). Unknown fields are refused."""
    unknown = set(item) - _PREFILL_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {sorted(map(str, unknown))}; known: {sorted(_PREFILL_KEYS)}")
    url = values.url(item.get("url"), where)
    dp_size = _dp_size(item, where)
    engine_id = item.get("engine_id")
    kinds = ", ".join(ConnectorKind)
    kind = str(item.get("connector", ConnectorKind.NIXL)).lower()
    if kind not in set(ConnectorKind):
        raise ConfigError(f"{where}: connector {kind!r} is not one of {kinds}")
    if engine_id in (None, "", "auto"):
        if "side_port" in item:
            raise ConfigError(f"{where}: side_port is given but engine_id is not; give both or neither (auto)")
        return WorkerSpec(url=url, role=Role.PREFILL, dp_size=dp_size)
    if "side_port" not in item:
        raise ConfigError(f"{where}: engine_id is given but side_port (the NIXL side-channel port) is not")
    engine = values.text(engine_id, f"{where}: engine_id")
    side_host = values.text(item.get("side_host"), f"{where}: side_host") or urlsplit(url).hostname
    identity = NixlIdentity(
        engine_id=str(engine),
        host=str(side_host),
        port=values.port(item["side_port"], f"{where}: side_port"),
        tp_size=values.integer(item.get("tp", 1), f"{where}: tp", low=1),
        pp_size=values.integer(item.get("pp", 1), f"{where}: pp", low=1),
        connector=ConnectorKind(kind),
    )
    if dp_size > 1 and split_rank(identity.engine_id)[1] is not None:
        raise ConfigError(
            f"{where}: engine_id {identity.engine_id!r} already names a data-parallel rank; give the engine id vLLM "
            "was started with (the router adds _dp<r> and side_port + r per rank)"
        )
    return WorkerSpec(url=url, role=Role.PREFILL, identity=identity, dp_size=dp_size)


def decode_from_mapping(item: Mapping[str, Any], *, where: str) -> WorkerSpec:
    """A decode worker from typed fields: `url` and optionally `dp` (decode workers need no identity)."""
    unknown = set(item) - _DECODE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {sorted(map(str, unknown))}; known: {sorted(_DECODE_KEYS)}")
    if values.integer(item.get("pp", 1), f"{where}: pp", low=1) != 1:
        raise ConfigError(f"{where}: pp must be 1: a push writes only into a decode without pipeline parallelism")
    tp = values.integer(item["tp"], f"{where}: tp", low=1) if "tp" in item else None
    url = values.url(item.get("url"), where)
    return WorkerSpec(url=url, role=Role.DECODE, dp_size=_dp_size(item, where), tp_size=tp)


def workers(value: Any, role: Role, *, where: str | None = None) -> tuple[WorkerSpec, ...]:
    """One role's static workers: a list (or a space-separated string) of SPEC strings (prefill), URLs, mappings
    of typed fields, or WorkerSpecs. A URL listed twice is refused."""
    where = where or f"{role} workers"
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
    out: list[WorkerSpec] = []
    for i, item in enumerate(items):
        at = f"{where} #{i + 1}"
        if isinstance(item, WorkerSpec):
            out.append(item)
        elif role is Role.PREFILL and isinstance(item, str):
            out.append(parse_prefill_spec(item))
        elif role is Role.PREFILL and isinstance(item, Mapping):
            out.append(prefill_from_mapping(item, where=at))
        elif isinstance(item, str):
            out.append(parse_decode_url(item))
        elif isinstance(item, Mapping):
            out.append(decode_from_mapping(item, where=at))
        else:
            raise ConfigError(f"{at}: expected a URL string or a mapping with url, got {type(item).__name__}")
    urls = [w.url for w in out]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where}: a URL is listed twice: {urls}")
    return tuple(out)
