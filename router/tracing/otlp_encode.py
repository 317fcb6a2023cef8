"""A lean OTLP/protobuf encoder of finished spans: ExportTraceServiceRequest bytes, written field by field.

Why: the OpenTelemetry SDK's encoder (opentelemetry-exporter-otlp-proto-common) builds one protobuf object per
span, attribute, event and value in Python; for the router's three spans per request that was about 35 us a span,
more than the router spends making them (bench/README.md, "Tracing overhead"). Writing the wire format directly
costs a fraction of it. The output parses to the same message as the SDK encoder's (tests compare the two on
spans of every shape the router makes and more). Pure: bytes in, bytes out.

Covered: resource (attributes), scope (name, version), span ids, trace state, parent, name, kind, times, flags,
attributes (str, bool, int, float and homogeneous sequences of them), events with attributes, links with
attributes, status, dropped counts. Values of other types are skipped (the SDK's own attribute cleaning never lets
them through).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode

from router.tracing import context as w3c
from router.tracing.trace import Span

_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
_HAS_IS_REMOTE = 0x100  # SpanFlags: the parent's is_remote is known
_IS_REMOTE = 0x200
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack
_pack_double = struct.Struct("<d").pack
_KIND_CODE = {code: b"\x30" + bytes((code,)) for code in _KIND.values()}  # Span.kind (field 6), by OTLP's number
_KIND_FIELD = {kind: _KIND_CODE[code] for kind, code in _KIND.items()}  # ... by SpanKind
_LOCAL_FLAGS = b"\x85\x01" + _pack_fixed32(_HAS_IS_REMOTE)  # Span.flags (field 16, fixed32), as the SDK's encoder:
_REMOTE_FLAGS = b"\x85\x01" + _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE)  # the W3C trace flags are not copied
_EMPTY_STATUS = b"\x7a\x00"  # Span.status (field 15), empty


_SMALL = [bytes((i,)) for i in range(128)]  # one-byte varints
_KEY_CACHE_MAX = 4096  # encoded attribute keys kept (keys are the router's own, a few dozen)
_PAIR_CACHE_MAX = 4096  # encoded attribute fields kept (emptied when full: unique ids pass through it)
_CACHED_TYPES = (str, bool, int, float)  # hashable values; the type is part of the key (1 == 1.0 == True)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 on the wire: two's complement, ten bytes
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2); field numbers here are all below 16 (one tag byte)."""
    n = len(payload)
    return _SMALL[(field << 3) | 2] + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _any_value(value: Any) -> bytes | None:
    if isinstance(value, str):
        raw = value.encode()
        n = len(raw)
        return b"\x0a" + (_SMALL[n] if n < 0x80 else _varint(n)) + raw
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        items = [v for v in (_any_value(item) for item in value) if v is not None]
        return _len(5, b"".join(_len(1, item) for item in items))  # ArrayValue{values=1}
    return None


class Encoder:
    """Encodes batches of finished spans; keeps the encoded attribute keys it has seen (bounded)."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._pairs: dict[tuple[int, str, type, Any], bytes] = {}
        self._names: dict[tuple[str, str], bytes] = {}
        self._states: dict[tuple[tuple[str, str], ...], bytes] = {}

    def encode(self, spans: Iterable[ReadableSpan | Span]) -> bytes:
        """ExportTraceServiceRequest bytes: spans grouped by resource, then by instrumentation scope. The router's
        own spans (router/tracing/trace.py `Span`) are written from their fields; any other ReadableSpan through
        its properties."""
        groups: dict[int, tuple[Any, dict[Any, list[bytes]]]] = {}
        scope: InstrumentationScope | None
        for span in spans:
            if isinstance(span, Span):
                resource, scope, encoded = span.recorder.resource, span.recorder.scope, self._lean_span(span)
            else:
                resource, scope, encoded = span.resource, span.instrumentation_scope, self._span(span)
            scopes = groups.setdefault(id(resource), (resource, {}))[1]
            key = None if scope is None else (scope.name, scope.version, scope.schema_url)
            scopes.setdefault(key, []).append(encoded)
        out = []
        for resource, scopes in groups.values():
            body = [_len(1, self._attributes(1, resource.attributes))]
            for key, encoded_spans in scopes.items():
                scope_body = b""
                if key is not None:
                    name, version, _ = key
                    scope_body = _len(1, name.encode()) + (_len(2, version.encode()) if version else b"")
                parts = [_len(1, scope_body), *(_len(2, s) for s in encoded_spans)]
                if key is not None and key[2]:
                    parts.append(_len(3, key[2].encode()))
                body.append(_len(2, b"".join(parts)))
            if resource.schema_url:
                body.append(_len(3, resource.schema_url.encode()))
            out.append(_len(1, b"".join(body)))
        return b"".join(out)

    def _key(self, key: str) -> bytes:
        """KeyValue.key, encoded (cached: attribute keys repeat in every span)."""
        encoded = self._keys.get(key)
        if encoded is None:
            encoded = _len(1, key.encode())
            if len(self._keys) < _KEY_CACHE_MAX:
                self._keys[key] = encoded
        return encoded

    def _attributes(self, field: int, attributes: Mapping[str, Any] | None) -> bytes:
        """The attributes as repeated KeyValue fields. A field seen before comes from the cache: most of the
        router's attributes repeat from span to span (operation, provider, worker, attempt, outcome, route)."""
        if not attributes:
            return b""
        pairs = self._pairs
        parts = []
        for key, value in attributes.items():
            kind = value.__class__
            cacheable = kind in _CACHED_TYPES
            encoded = pairs.get((field, key, kind, value)) if cacheable else None
            if encoded is None:
                encoded = self._pair(field, key, value)
                if encoded and cacheable:
                    if len(pairs) >= _PAIR_CACHE_MAX:
                        pairs.clear()
                    pairs[(field, key, kind, value)] = encoded
            parts.append(encoded)
        return b"".join(parts)

    def _pair(self, field: int, key: str, value: Any) -> bytes:
        """One KeyValue as field `field` (empty for a value of a type OTLP has no AnyValue for)."""
        encoded = _any_value(value)
        if encoded is None:
            return b""
        n = len(encoded)
        pair = self._key(key) + b"\x12" + (_SMALL[n] if n < 0x80 else _varint(n)) + encoded
        m = len(pair)
        return _SMALL[(field << 3) | 2] + (_SMALL[m] if m < 0x80 else _varint(m)) + pair

    def _span(self, span: ReadableSpan) -> bytes:
        ctx = span.context
        assert ctx is not None
        head, remote = _ids(ctx, span.parent)
        out = [
            head,
            self._name(span.name),
            _KIND_FIELD[span.kind],
            b"\x39" + _pack_fixed64(span.start_time or 0),
            b"\x41" + _pack_fixed64(span.end_time or 0),
            self._attributes(9, span.attributes),
        ]
        if span.dropped_attributes:
            out.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            body = b"\x09" + _pack_fixed64(event.timestamp) + self._event_name(event.name)
            out.append(_len(11, body + self._attributes(3, event.attributes)))
        if span.dropped_events:
            out.append(b"\x60" + _varint(span.dropped_events))
        for link in span.links:
            lctx = link.context
            body = b"\x0a\x10" + lctx.trace_id.to_bytes(16, "big") + b"\x12\x08" + lctx.span_id.to_bytes(8, "big")
            body += self._attributes(4, link.attributes)
            body += b"\x35" + _pack_fixed32(_HAS_IS_REMOTE | (_IS_REMOTE if lctx.is_remote else 0))
            out.append(_len(13, body))
        if span.dropped_links:
            out.append(b"\x70" + _varint(span.dropped_links))
        out.append(_status(span.status))
        out.append(_REMOTE_FLAGS if remote else _LOCAL_FLAGS)
        return b"".join(out)

    def _lean_span(self, span: Span) -> bytes:
        """A span the router recorded, written from its fields: the same bytes as `_span` writes for its
        ReadableSpan (`Span.readable`; the tests compare them). It has no links and drops nothing."""
        head = b"\x0a\x10" + span.trace_id.to_bytes(16, "big") + b"\x12\x08" + span.span_id.to_bytes(8, "big")
        if span.trace_state:
            head += self._trace_state(span.trace_state)
        if span.parent_id:
            head += b"\x22\x08" + span.parent_id.to_bytes(8, "big")
        out = [
            head,
            self._name(span.name),
            _KIND_CODE[span.kind],
            b"\x39" + _pack_fixed64(span.start_time) + b"\x41" + _pack_fixed64(span.end_time),
            self._attributes(9, span.attrs),
        ]
        if span.events:
            for name, at, attributes in span.events:
                body = b"\x09" + _pack_fixed64(at) + self._event_name(name)
                out.append(_len(11, body + self._attributes(3, attributes)))
        out.append(_EMPTY_STATUS if span.error is None else _error_status(span.error))
        out.append(_REMOTE_FLAGS if span.parent_remote else _LOCAL_FLAGS)
        return b"".join(out)

    def _trace_state(self, members: tuple[tuple[str, str], ...]) -> bytes:
        """Span.trace_state (field 3) of W3C tracestate members, encoded; cached (a client sends the same state
        on many requests; emptied when full)."""
        encoded = self._states.get(members)
        if encoded is None:
            encoded = _len(3, w3c.tracestate(members).encode())
            if len(self._states) >= _KEY_CACHE_MAX:
                self._states.clear()
            self._states[members] = encoded
        return encoded

    def _name(self, name: str) -> bytes:
        """Span.name (field 5), encoded; cached with the keys (the router's span names repeat)."""
        return self._cached(("span", name), 5, name)

    def _event_name(self, name: str) -> bytes:
        """Event.name (field 2), encoded, cached likewise."""
        return self._cached(("event", name), 2, name)

    def _cached(self, key: tuple[str, str], field: int, text: str) -> bytes:
        encoded = self._names.get(key)
        if encoded is None:
            encoded = _len(field, text.encode())
            if len(self._names) >= _KEY_CACHE_MAX:
                self._names.clear()
            self._names[key] = encoded
        return encoded


def _status(status: Status) -> bytes:
    """Span.status (field 15): always present, empty when unset (as the SDK's encoder writes it)."""
    code = _STATUS[status.status_code]
    if not code and not status.description:
        return _EMPTY_STATUS
    body = (_len(2, status.description.encode()) if status.description else b"") + (
        b"\x18" + _varint(code) if code else b""
    )
    return _len(15, body)


def _error_status(description: str) -> bytes:
    """Span.status (field 15) of a failed span: its description and STATUS_CODE_ERROR."""
    return _len(15, (_len(2, description.encode()) if description else b"") + b"\x18\x02")


def _ids(ctx: Any, parent: Any) -> tuple[bytes, bool]:
    """A span's trace id, span id, trace state and parent span id fields, and whether its parent is remote."""
    head = b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big") + b"\x12\x08" + ctx.span_id.to_bytes(8, "big")
    if ctx.trace_state:
        head += _len(3, ctx.trace_state.to_header().encode())
    if parent is None:
        return head, False
    return head + b"\x22\x08" + parent.span_id.to_bytes(8, "big"), bool(parent.is_remote)
