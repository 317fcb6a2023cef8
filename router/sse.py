"""Server-sent events: whole-event framing for the first events, a byte-exact relay check for the rest. Pure.

Both run in time linear in the bytes fed (a separator is searched for once per byte, not once per chunk) and
bound one event to `max_event_bytes`: a stream that never ends an event fails instead of filling memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from router.errors import RouterError

_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")
_LONGEST = max(len(sep) for sep in _SEPARATORS)
_decode = msgspec.json.Decoder().decode


class EventTooLarge(ValueError):
    """An upstream event grew past the bound without its closing blank line."""


class EventFramer:
    """Feeds arbitrary chunks in, yields complete events (each ending in its blank line) out, in order.

    An event is never split and never merged with the next one, so each relayed chunk is exactly one event.
    """

    def __init__(self, max_event_bytes: int = 8 * 2**20) -> None:
        self._buffer = bytearray()
        self._max = max_event_bytes
        # per separator: where it next occurs in the buffer (-1: nowhere below `_searched[sep]`), and from
        # where the buffer has not been searched for it yet
        self._hit: dict[bytes, int] = dict.fromkeys(_SEPARATORS, -1)
        self._searched: dict[bytes, int] = dict.fromkeys(_SEPARATORS, 0)

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer
        if not buffer and b"\r" not in chunk:  # the common case, LF-framed events: one split, no scanning state
            *whole, rest = chunk.split(b"\n\n")
            if len(rest) > self._max:
                raise EventTooLarge(f"an event grew past {self._max} bytes without ending")
            buffer += rest
            self._hit = dict.fromkeys(_SEPARATORS, -1)
            self._searched = dict.fromkeys(_SEPARATORS, 0)
            return [event + b"\n\n" for event in whole]
        buffer += chunk
        events: list[bytes] = []
        start = 0
        while True:
            ends = [e for sep in _SEPARATORS if (e := self._end(sep, start)) >= 0]
            if not ends:
                break
            cut = min(ends)
            events.append(bytes(buffer[start:cut]))
            start = cut
        if start:
            del buffer[:start]
            for sep in _SEPARATORS:
                self._hit[sep] = self._hit[sep] - start if self._hit[sep] >= start else -1
                self._searched[sep] = max(0, self._searched[sep] - start)
        if len(buffer) > self._max:
            raise EventTooLarge(f"an event grew past {self._max} bytes without ending")
        return events

    def _end(self, sep: bytes, start: int) -> int:
        """The end of the first `sep` at or after `start`, or -1; every byte is searched once per separator."""
        hit = self._hit[sep]
        if hit < start:
            hit = self._buffer.find(sep, max(start, self._searched[sep]))
            self._hit[sep] = hit
            # no occurrence starts before this position, except the cached hit
            self._searched[sep] = hit + 1 if hit >= 0 else max(0, len(self._buffer) - len(sep) + 1)
        return -1 if hit < 0 else hit + len(sep)

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an unterminated last event), or b""."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self._hit = dict.fromkeys(_SEPARATORS, -1)
        self._searched = dict.fromkeys(_SEPARATORS, 0)
        return rest


class RelayCheck:
    """Watches a stream relayed byte for byte (no re-framing): bounds the open event, keeps the usage event.

    Per chunk: three `rfind`s over that chunk and a look at the seam with the previous one.
    """

    def __init__(self, max_event_bytes: int, usage_of: Callable[[Any], dict[str, Any] | None] | None = None) -> None:
        self._max = max_event_bytes
        self._usage_of = usage_of or _top_level_usage  # an event's usage (its API's, router/apis.py)
        self._open = 0  # bytes since the last event separator
        self._seam = b""  # the last few bytes of the previous chunk
        self.usage_chunk: bytes | None = None  # the last chunk that carried a usage object

    def feed(self, chunk: bytes) -> None:
        end = max((i + len(sep) for sep in _SEPARATORS if (i := chunk.rfind(sep)) >= 0), default=-1)
        if end < 0 and self._seam:
            joined = self._seam + chunk[: _LONGEST - 1]
            seam_end = max((i + len(sep) for sep in _SEPARATORS if (i := joined.rfind(sep)) >= 0), default=-1)
            if seam_end > len(self._seam):
                end = seam_end - len(self._seam)
        self._open = len(chunk) - end if end >= 0 else self._open + len(chunk)
        self._seam = chunk[-(_LONGEST - 1) :]
        if self._open > self._max:
            raise EventTooLarge(f"an event grew past {self._max} bytes without ending")
        if b'"usage"' in chunk:
            self.usage_chunk = chunk

    def usage(self) -> dict[str, Any] | None:
        """The usage object of the last event that carried one (vLLM sends it last, with include_usage)."""
        if self.usage_chunk is None:
            return None
        found: dict[str, Any] | None = None
        for event in EventFramer(self._max).feed(self.usage_chunk + b"\n\n"):
            usage = self._usage_of(payload_of(event))
            if usage is not None:
                found = usage
        return found


def _top_level_usage(payload: Any) -> dict[str, Any] | None:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None


def payload_of(event: bytes) -> Any:
    """The JSON of an event's `data:` line, or None (comments, [DONE], non-JSON). The event may be led by its
    `event:` line (Anthropic's Messages and OpenAI's Responses streams)."""
    if event.startswith(b"event:"):
        at = event.find(b"\ndata:")
        if at < 0:
            return None
        event = event[at + 1 :]
    elif not event.startswith(b"data:"):
        return None
    try:
        return _decode(event[5:].strip())
    except (msgspec.DecodeError, ValueError):
        return None


def error_of(event: bytes) -> str | None:
    """The message of an in-band error event, or None for any other event: OpenAI's `data: {"error": ...}`,
    Anthropic's `{"type": "error", "error": {...}}`, the Responses API's `{"type": "error", "message": ...}`."""
    if b'"error"' not in event or not event.startswith((b"data:", b"event:")):
        return None
    payload = payload_of(event)
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if error is None:
        return str(payload.get("message", "error")) if payload.get("type") == "error" else None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def error_event(error: RouterError) -> bytes:
    """An in-band error for a stream whose 200 is already sent, in the shape OpenAI clients understand."""
    return b"data: " + json.dumps(error.to_body()).encode() + b"\n\n"
