"""Server-sent events framing: split an upstream byte stream into whole events, relayed one for one. Pure."""

from __future__ import annotations

import json

from router.errors import RouterError

_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


class EventFramer:
    """Feeds arbitrary chunks in, yields complete events (each ending in its blank line) out, in order.

    An event is never split and never merged with the next one, so each relayed chunk is exactly one event.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events: list[bytes] = []
        while True:
            cut = _first_boundary(self._buffer)
            if cut is None:
                return events
            events.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an unterminated last event), or b""."""
        rest, self._buffer = self._buffer, b""
        return rest


def _first_boundary(buffer: bytes) -> int | None:
    ends = [i + len(sep) for sep in _SEPARATORS if (i := buffer.find(sep)) >= 0]
    return min(ends) if ends else None


def error_of(event: bytes) -> str | None:
    """The message of an in-band error event (`data: {"error": ...}`), or None for any other event."""
    if not event.startswith(b"data:") or b'"error"' not in event:
        return None
    try:
        payload = json.loads(event[5:])
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if error is None:
        return None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def error_event(error: RouterError) -> bytes:
    """An in-band error for a stream whose 200 is already sent, in the shape OpenAI clients understand."""
    return b"data: " + json.dumps(error.to_body()).encode() + b"\n\n"
