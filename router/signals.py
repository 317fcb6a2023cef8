"""The stop signals (SIGTERM, SIGINT) while the router serves (router/drain.py's uvicorn server).

From the start of serving the server's handler takes them; from the end of serving to the process's exit they are
ignored. They never fall back to the default disposition in between: a supervisor that signals again while the
drained router is on its way out (the stack's stop does, Kubernetes may) would otherwise end a clean exit with the
signal's status (-15) instead of 0. Before serving starts the default stands: a router still starting dies at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], None]


@contextlib.contextmanager
def stop_signals_to(handler: Handler) -> Iterator[None]:
    """`handler` gets SIGTERM and SIGINT inside; on the way out both are ignored for the rest of the process's
    life. Only the main thread may set handlers: from any other thread (a server run in a test's thread) nothing
    is installed, as uvicorn does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:  # handler -> ignored directly: no default disposition in between
            signal.signal(sig, signal.SIG_IGN)
