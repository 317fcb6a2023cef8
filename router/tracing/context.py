"""W3C Trace Context and Baggage on the wire: what a client sent, bounded and checked, and what each leg gets.

Pure. The router reads `traceparent`, `tracestate` and `baggage` from the client's raw ASGI headers and never lets
them steer anything but the trace: a value that is malformed, oversized, repeated where it may not be, or not
printable ASCII is dropped without a word (no log line a client could flood), as if the client had sent nothing,
and the request gets a new root trace. The rules (W3C Trace Context level 1, W3C Baggage):

- `traceparent`: `VERSION-TRACEID-PARENTID-FLAGS`, lower-case hex; version `ff` is invalid; version `00` is exactly
  55 characters; a later version may carry more after a `-` (only the first four fields are read); all-zero trace
  or parent ids are invalid; more than one `traceparent` header is invalid; optional whitespace around it is
  trimmed. Only the sampled bit of the flags is kept (what the router re-emits is always version `00`).
- `tracestate`: read only with a valid `traceparent`; several headers are one list (joined by commas); at most 32
  members and 512 characters are kept (further members are dropped whole); a member with a bad key or value, or a
  key seen before, is dropped (the first one wins).
- `baggage`: several headers are one list; at most 64 members and 8,192 bytes are kept (further members dropped
  whole); a member that does not parse is dropped. The router does not read baggage, it only passes it on.

`TraceHeaders` (what came in, checked) is what the rest of tracing works with; `leg_headers` is what goes out on
both legs (the parent there is the leg's own span).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BAGGAGE = "baggage"
NAMES = frozenset({TRACEPARENT.encode(), TRACESTATE.encode(), BAGGAGE.encode()})  # ASGI header names are bytes

MAX_TRACEPARENT_CHARS = 512  # a later version may be longer than 55; longer than this is not a traceparent
MAX_TRACESTATE_MEMBERS = 32  # W3C: at most 32 list members
MAX_TRACESTATE_CHARS = 512  # W3C: propagate at least 512 characters; members beyond are dropped whole
MAX_BAGGAGE_MEMBERS = 64  # W3C Baggage: at least 64 members must be propagated; more are dropped
MAX_BAGGAGE_BYTES = 8192  # W3C Baggage: at least 8,192 bytes; members beyond are dropped whole
MAX_HEADER_BYTES = 16384  # one raw header value read at all (the app's header limits bound the sum)

_PRINTABLE = re.compile(rb"[\t\x20-\x7e]*")
_HEX = frozenset("0123456789abcdef")
_SAMPLED = 0x01
_KEY = re.compile(r"[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}")
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAGGAGE_VALUE = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*")  # baggage-octet / percent-encoded


@dataclass(frozen=True)
class ParentContext:
    """A valid remote parent from `traceparent` (+ its `tracestate`)."""

    trace_id: int
    span_id: int
    sampled: bool
    trace_state: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TraceHeaders:
    """The client's trace headers after checking: a parent (or None: a new root) and the baggage to pass on."""

    parent: ParentContext | None = None
    baggage: str | None = None  # re-joined, bounded; None when there was none (or none that parsed)


NO_HEADERS = TraceHeaders()


def read(headers: Iterable[tuple[bytes, bytes]]) -> TraceHeaders:
    """The checked trace headers among raw ASGI headers (lower-case names, as ASGI servers give them)."""
    parents: list[bytes] = []
    states: list[bytes] = []
    baggage: list[bytes] = []
    for name, value in headers:
        if name in NAMES:
            if len(value) > MAX_HEADER_BYTES:
                continue
            if name == b"traceparent":
                parents.append(value)
            elif name == b"tracestate":
                states.append(value)
            else:
                baggage.append(value)
    if not parents and not baggage:
        return NO_HEADERS
    parent = parse_traceparent(parents[0]) if len(parents) == 1 else None
    if parent is not None and states:
        parent = ParentContext(parent.trace_id, parent.span_id, parent.sampled, parse_tracestate(states))
    return TraceHeaders(parent, parse_baggage(baggage))


def _ascii(raw: bytes) -> str | None:
    """The value as text when it is printable ASCII (tabs allowed), else None."""
    return raw.decode("ascii") if _PRINTABLE.fullmatch(raw) else None


def parse_traceparent(raw: bytes) -> ParentContext | None:
    """The parent a `traceparent` value names, or None when it is not a valid one."""
    text = _ascii(raw)
    if text is None:
        return None
    text = text.strip(" \t")
    if len(text) < 55 or len(text) > MAX_TRACEPARENT_CHARS:
        return None
    version, trace_id, span_id, flags = text[0:2], text[3:35], text[36:52], text[53:55]
    if text[2] != "-" or text[35] != "-" or text[52] != "-":
        return None
    if not _is_hex(version) or version == "ff" or not (_is_hex(trace_id) and _is_hex(span_id) and _is_hex(flags)):
        return None
    if version == "00" and len(text) != 55:
        return None
    if len(text) > 55 and text[55] != "-":
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0:
        return None
    return ParentContext(tid, sid, bool(int(flags, 16) & _SAMPLED))


def _is_hex(text: str) -> bool:
    return all(c in _HEX for c in text)


def parse_tracestate(values: list[bytes]) -> tuple[tuple[str, str], ...]:
    """The valid members of the `tracestate` header(s), first key wins, within the member and length bounds."""
    members: list[tuple[str, str]] = []
    seen: set[str] = set()
    length = 0
    for raw in values:
        text = _ascii(raw)
        if text is None:
            continue
        for item in text.split(","):
            item = item.strip(" \t")
            key, eq, value = item.partition("=")
            if not item or not eq or key in seen or not _KEY.fullmatch(key) or not _VALUE.fullmatch(value):
                continue
            added = len(item) + (1 if members else 0)
            if len(members) == MAX_TRACESTATE_MEMBERS or length + added > MAX_TRACESTATE_CHARS:
                return tuple(members)
            members.append((key, value))
            seen.add(key)
            length += added
    return tuple(members)


def parse_baggage(values: list[bytes]) -> str | None:
    """The `baggage` header(s) re-joined from the members that parse, within the member and byte bounds."""
    kept: list[str] = []
    size = 0
    for raw in values:
        text = _ascii(raw)
        if text is None:
            continue
        for item in text.split(","):
            member = _baggage_member(item)
            if member is None:
                continue
            added = len(member) + (1 if kept else 0)
            if len(kept) == MAX_BAGGAGE_MEMBERS or size + added > MAX_BAGGAGE_BYTES:
                return ",".join(kept) or None
            kept.append(member)
            size += added
    return ",".join(kept) or None


def _baggage_member(item: str) -> str | None:
    """`key=value(;property)*` normalised (whitespace around the parts removed), or None."""
    head, *properties = item.split(";")
    key, eq, value = head.partition("=")
    key, value = key.strip(" \t"), value.strip(" \t")
    if not eq or not _TOKEN.fullmatch(key) or not _BAGGAGE_VALUE.fullmatch(value):
        return None
    parts = [f"{key}={value}"]
    for prop in properties:
        pkey, peq, pvalue = prop.partition("=")
        pkey, pvalue = pkey.strip(" \t"), pvalue.strip(" \t")
        if not _TOKEN.fullmatch(pkey) or (peq and not _BAGGAGE_VALUE.fullmatch(pvalue)):
            return None
        parts.append(f"{pkey}={pvalue}" if peq else pkey)
    return ";".join(parts)


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """A version-00 `traceparent` value."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def tracestate(members: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{k}={v}" for k, v in members)


def leg_headers(
    trace_hex: str, span_id: int, sampled: bool, state: Sequence[tuple[str, str]], baggage: str | None
) -> dict[str, str]:
    """The headers a leg carries so that the worker's own spans join the trace under span `span_id`; `trace_hex`:
    the trace id in its 32 hex digits (a request writes it once for all its legs)."""
    out = {TRACEPARENT: f"00-{trace_hex}-{span_id:016x}-{'01' if sampled else '00'}"}
    if state:
        out[TRACESTATE] = tracestate(state)
    if baggage:
        out[BAGGAGE] = baggage
    return out
