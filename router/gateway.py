"""The decode-pod sidecar behind a Gateway API InferencePool: what the gateway's endpoint picker (EPP) decided,
read from the request's headers. Pure.

llm-d's EPP (llm-d-router's P/D scheduling profiles, deploy/k8s/components/inference-pool/epp-config.yaml) picks
the decode pod, which the gateway sends the request to, and the prefill endpoint, which it names in
`x-prefiller-host-port` as `host:port` (its `disagg-profile-handler`). The kvpush router in that decode pod then
runs both legs at once (push): the prefill is known before either leg leaves. The session rides in the client's
session header, which the router's conversation decider reads for affinity (`SESSION_HEADER`, `x-session-id`,
or the first of `session_headers`).

The header is an instruction from the network to dial a host, so it is trusted only as far as the pool goes: the
named endpoint must be a member of the router's own prefill pool (static or discovered); anything else (a host
outside the pool, a malformed or oversized value, the header twice) is refused with a 400 before any connection
is made. Without the header the router chooses the prefill itself, or refuses when `require_prefill` is set.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.deciders.conversation import MAX_SESSION_CHARS, SESSION_HEADER
from router.domain import WorkerSpec
from router.errors import BadRequest, ConfigError

__all__ = [
    "DEFAULT_SESSION_HEADERS",
    "MAX_HOST_PORT_CHARS",
    "PREFILLER_HEADER",
    "GatewayPick",
    "GatewaySettings",
    "HostPort",
    "PrefillHeader",
    "member_for",
    "parse_gateway",
    "parse_host_port",
    "read_gateway_headers",
]

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's convention (pkg/common/routing)
DEFAULT_SESSION_HEADERS = (SESSION_HEADER,)  # the router's own; llm-d's EPP reads the same one
MAX_HOST_PORT_CHARS = 262  # a 253-character DNS name, brackets, a colon and five digits
_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[0-9]{1,5}$")
_SESSION = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII, no spaces: a session id is logged and hashed


class PrefillHeader(enum.StrEnum):
    """What the router does with `x-prefiller-host-port` (the `gateway.prefill_header` setting)."""

    OFF = "off"  # ignored: the router picks the prefill (not behind an EPP, or one that does not do P/D)
    OPTIONAL = "optional"  # taken when present (a member only, else 400); absent: the router picks
    REQUIRED = "required"  # absent: 400 (every request comes through an EPP that names a prefill)


@dataclass(frozen=True)
class GatewaySettings:
    """The `gateway:` block: `{prefill_header: off|optional|required, session_headers: [NAME, ...]}`."""

    prefill_header: PrefillHeader = PrefillHeader.OFF
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS

    @property
    def on(self) -> bool:
        return self.prefill_header is not PrefillHeader.OFF


_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def parse_gateway(value: Any) -> GatewaySettings:
    """The `gateway:` setting, checked. Raises ConfigError naming the offending key."""
    if not isinstance(value, Mapping):
        raise ConfigError("gateway: expected a mapping {prefill_header: off|optional|required, session_headers: [...]}")
    unknown = set(value) - {"prefill_header", "session_headers"}
    if unknown:
        raise ConfigError(
            f"gateway: unknown key(s) {sorted(map(str, unknown))}; known: prefill_header, session_headers"
        )
    raw_mode = value.get("prefill_header", PrefillHeader.OFF)
    if raw_mode is False:  # YAML reads a bare `off` as false
        raw_mode = PrefillHeader.OFF
    try:
        mode = PrefillHeader(str(raw_mode).lower())
    except ValueError:
        raise ConfigError(f"gateway.prefill_header: expected off, optional or required, got {raw_mode!r}") from None
    names = value.get("session_headers", DEFAULT_SESSION_HEADERS)
    if isinstance(names, str):
        names = [names]
    if (
        not isinstance(names, list | tuple)
        or not names
        or not all(isinstance(n, str) and _HEADER_NAME.match(n) for n in names)
    ):
        raise ConfigError("gateway.session_headers: expected a non-empty list of header names")
    return GatewaySettings(mode, tuple(n.lower() for n in names))


@dataclass(frozen=True)
class HostPort:
    """A parsed `host:port`: the host lower-cased (an IPv6 address without brackets, in its compressed form)."""

    host: str
    port: int


@dataclass(frozen=True)
class GatewayPick:
    """What the gateway decided for one request: the prefill member it named (None: not named, the router
    chooses) and the session id (None: none given)."""

    prefill: WorkerSpec | None
    session: str | None


def parse_host_port(value: str) -> HostPort:
    """`host:port`, `[v6]:port` or `v4:port` → HostPort. Raises BadRequest naming the header, never echoing more
    than a bounded prefix of the value."""
    shown = repr(value[:80])
    if len(value) > MAX_HOST_PORT_CHARS:
        raise BadRequest(f"{PREFILLER_HEADER} is over {MAX_HOST_PORT_CHARS} characters")
    text = value.strip()
    if "," in text:
        raise BadRequest(f"{PREFILLER_HEADER} must name one prefill endpoint as host:port, got {shown}")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or ":" not in host:
            raise BadRequest(f"{PREFILLER_HEADER}: expected [IPv6]:port, got {shown}")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise BadRequest(f"{PREFILLER_HEADER}: expected host:port (IPv6 in brackets), got {shown}")
    return HostPort(_host(host, shown), _port(port, shown))


def _host(host: str, shown: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.lower().removesuffix(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.match(label) for label in name.split(".")):
        raise BadRequest(f"{PREFILLER_HEADER}: {shown} does not name a host (an IP address or a DNS name)")
    return name


def _port(port: str, shown: str) -> int:
    if not _PORT.match(port) or not 1 <= int(port) <= 65535:
        raise BadRequest(f"{PREFILLER_HEADER}: {shown} has no port in 1..65535")
    return int(port)


def _endpoint(spec: WorkerSpec) -> HostPort | None:
    """A member's URL as the gateway would name it (the scheme's default port when the URL has none)."""
    parts = urlsplit(spec.url)
    if parts.hostname is None:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    try:
        host = str(ipaddress.ip_address(parts.hostname))
    except ValueError:
        host = parts.hostname.lower().removesuffix(".")
    return HostPort(host, port)


def member_for(named: HostPort, members: Sequence[WorkerSpec]) -> WorkerSpec | None:
    """The prefill pool member the gateway named, matched by host and port (no DNS lookup: a name matches a
    member configured by that name, an address a member configured or discovered by that address)."""
    for spec in members:
        if _endpoint(spec) == named:
            return spec
    return None


def read_gateway_headers(
    headers: Iterable[tuple[bytes, bytes]],
    prefills: Sequence[WorkerSpec],
    *,
    require_prefill: bool = False,
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
) -> GatewayPick:
    """The gateway's pick from a request's raw (ASGI) headers and the router's current prefill members.

    Raises BadRequest (400) when the prefill header is malformed, given twice, names an endpoint outside
    `prefills`, or is missing while `require_prefill`."""
    wanted = {PREFILLER_HEADER.encode(), *(name.lower().encode() for name in session_headers)}
    seen: dict[str, list[str]] = {}
    for name, value in headers:
        key = name.lower()
        if key in wanted:
            seen.setdefault(key.decode("latin-1"), []).append(value.decode("latin-1"))
    named = seen.get(PREFILLER_HEADER, [])
    if len(named) > 1:
        raise BadRequest(f"{PREFILLER_HEADER} is given {len(named)} times; the gateway names one prefill")
    prefill = None
    if named:
        endpoint = parse_host_port(named[0])
        prefill = member_for(endpoint, prefills)
        if prefill is None:
            raise BadRequest(f"{PREFILLER_HEADER} names a prefill endpoint that is not in this router's prefill pool")
    elif require_prefill:
        raise BadRequest(f"{PREFILLER_HEADER} is missing: this router serves behind a gateway that names the prefill")
    return GatewayPick(prefill=prefill, session=_session(seen, session_headers))


def _session(seen: dict[str, list[str]], session_headers: Sequence[str]) -> str | None:
    """The first usable value of the session headers, in their order; an empty, oversized or non-visible one is
    ignored (as the conversation decider ignores it), never refused: affinity is a hint."""
    for name in session_headers:
        for value in seen.get(name.lower(), []):
            text = value.strip()
            if 0 < len(text) <= MAX_SESSION_CHARS and _SESSION.match(text):
                return text
    return None
