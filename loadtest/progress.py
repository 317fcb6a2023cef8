"""Progress of a run on a text stream: on a terminal a one-line bar redrawn in place at most every `interval_s`
of the injected clock; elsewhere (a log file, a pipe) one plain line at most every `log_interval_s`, plus the
last one, so a bench log gets a few readable lines instead of one long carriage-return line."""

from collections.abc import Callable
from typing import TextIO

WIDTH = 30


def render(label: str, done: int, failed: int, total: int, elapsed_s: float) -> str:
    filled = WIDTH * done // total if total else WIDTH
    bar = "#" * filled + "." * (WIDTH - filled)
    return f"{label} [{bar}] {done}/{total} failed {failed} {elapsed_s:6.1f}s"


def is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Counts finished requests; draws on `stream` (None = silent): with '\\r' on a terminal, a line per draw
    elsewhere. `tty` overrides what the stream says it is."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None,
        clock: Callable[[], float],
        label: str = "",
        interval_s: float = 0.2,
        *,
        tty: bool | None = None,
        log_interval_s: float = 5.0,
    ):
        self.total = total
        self.done = 0
        self.failed = 0
        self._stream = stream
        self._clock = clock
        self._label = label
        self._tty = is_terminal(stream) if tty is None else tty
        self._interval = interval_s if self._tty else log_interval_s
        self._t0 = clock()
        self._last_draw = -1e9
        self._drawn: tuple[int, int] | None = None  # (done, failed) of the last line written

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = self._clock()
        if now - self._last_draw >= self._interval or self.done == self.total:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = (self.done, self.failed)
        if self._stream is not None:
            line = render(self._label, self.done, self.failed, self.total, now - self._t0)
            self._stream.write("\r" + line if self._tty else line + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._stream is None:
            return
        if self._tty:
            self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()
        elif self._drawn != (self.done, self.failed):  # the last state is in the log once
            self._draw(self._clock())
