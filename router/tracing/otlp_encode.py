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
from opentelemetry.trace import SpanKind, StatusCode

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


_SMALL = [bytes((i,)) for i in range(128)]  # one-byte varints
_KEY_CACHE_MAX = 4096  # encoded attribute keys kept (keys are the router's own, a few dozen)


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

    def encode(self, spans: Iterable[ReadableSpan]) -> bytes:
        """ExportTraceServiceRequest bytes: spans grouped by resource, then by instrumentation scope."""
        groups: dict[int, tuple[Any, dict[Any, list[bytes]]]] = {}
        for span in spans:
            resource = span.resource
            scopes = groups.setdefault(id(resource), (resource, {}))[1]
            scope = span.instrumentation_scope
            key = None if scope is None else (scope.name, scope.version, scope.schema_url)
            scopes.setdefault(key, []).append(self._span(span))
        out = []
        for resource, scopes in groups.values():
            body = [_len(1, self._attributes(1, resource.attributes))]
            for key, encoded in scopes.items():
                scope_body = b""
                if key is not None:
                    name, version, _ = key
                    scope_body = _len(1, name.encode()) + (_len(2, version.encode()) if version else b"")
                parts = [_len(1, scope_body), *(_len(2, s) for s in encoded)]
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
        if not attributes:
            return b""
        tag = _SMALL[(field << 3) | 2]
        parts = []
        for key, value in attributes.items():
            encoded = _any_value(value)
            if encoded is not None:
                n = len(encoded)
                pair = self._key(key) + b"\x12" + (_SMALL[n] if n < 0x80 else _varint(n)) + encoded
                m = len(pair)
                parts.append(tag + (_SMALL[m] if m < 0x80 else _varint(m)) + pair)
        return b"".join(parts)

    def _span(self, span: ReadableSpan) -> bytes:
        ctx = span.context
        assert ctx is not None
        out = [
            b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + ctx.span_id.to_bytes(8, "big"),
        ]
        if ctx.trace_state:
            out.append(_len(3, ctx.trace_state.to_header().encode()))
        flags = _HAS_IS_REMOTE  # as the SDK's encoder: the W3C trace flags are not copied here
        if span.parent is not None:
            out.append(b"\x22\x08" + span.parent.span_id.to_bytes(8, "big"))
            if span.parent.is_remote:
                flags |= _IS_REMOTE
        out.append(_len(5, span.name.encode()))
        out.append(b"\x30" + _varint(_KIND[span.kind]))
        out.append(b"\x39" + _pack_fixed64(span.start_time or 0))
        out.append(b"\x41" + _pack_fixed64(span.end_time or 0))
        out.append(self._attributes(9, span.attributes))
        if span.dropped_attributes:
            out.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            body = (
                b"\x09"
                + _pack_fixed64(event.timestamp)
                + _len(2, event.name.encode())
                + self._attributes(3, event.attributes)
            )
            out.append(_len(11, body))
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
        status = span.status
        code = _STATUS[status.status_code]
        body = (_len(2, status.description.encode()) if status.description else b"") + (
            b"\x18" + _varint(code) if code else b""
        )
        out.append(_len(15, body))  # always present, empty when unset (as the SDK's encoder writes it)
        out.append(b"\x85\x01" + _pack_fixed32(flags))  # field 16, fixed32
        return b"".join(out)
