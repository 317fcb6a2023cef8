"""The garbage collector's view of a started router: what start-up built is set aside, once.

CPython's full (oldest-generation) collection walks every tracked object, and a started router holds a few
hundred thousand that live as long as the process (modules, classes, FastAPI's routes, and with tracing on the
OpenTelemetry SDK, protobuf and gRPC). Under the overhead load a full collection came every ~800 requests and
cost 30-40 ms, ~40 us a request untraced and more traced (bench/README.md "Tracing overhead": the traced
router's heap is larger, and its queued spans survive the young collections, so full ones come more often).
`settle` collects what start-up left behind and freezes the rest (`gc.freeze`: moved to a permanent generation
that no collection walks), so collections walk only what requests make. Called once, when the service has
started (router/app.py's lifespan, when the served router asks: router/cli.py). Frozen objects are still freed by
reference counting; only a reference cycle among them that becomes garbage later stays (start-up's objects live
as long as the process).
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collects start-up's garbage, then freezes every tracked object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
