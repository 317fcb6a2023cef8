"""A one-line progress bar on a text stream, redrawn at most every `interval_s` of the injected clock."""

from collections.abc import Callable
from typing import TextIO

WIDTH = 30


def render(label: str, done: int, failed: int, total: int, elapsed_s: float) -> str:
    filled = WIDTH * done // total if total else WIDTH
    bar = "#" * filled + "." * (WIDTH - filled)
    return f"{label} [{bar}] {done}/{total} failed {failed} {elapsed_s:6.1f}s"


class Progress:
    """Counts finished requests; draws with '\\r' on `stream` (None = silent)."""

    def __init__(
        self, total: int, stream: TextIO | None, clock: Callable[[], float], label: str = "", interval_s: float = 0.2
    ):
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream
        self._clock = clock
        self._label = label
        self._interval = interval_s
        self._t0 = clock()
        self._last_draw = -1e9

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = self._clock()
        if now - self._last_draw >= self._interval or self.done == self.total:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        if self._stream is not None:
            line = render(self._label, self.done, self.failed, self.total, now - self._t0)
            self._stream.write("\r" + line)
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()
