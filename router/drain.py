"""Graceful drain on SIGTERM/SIGINT: /ready goes 503 first, the listener closes after a delay, requests in flight
get a grace period (uvicorn's graceful shutdown), then whatever still runs is cancelled, which closes both
upstream legs. A second signal skips the delay."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractContextManager
from types import FrameType
from typing import Protocol

import uvicorn

from router.signals import stop_signals_to

logger = logging.getLogger("kvpush.drain")


class Drainable(Protocol):
    def begin_drain(self) -> None: ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Drainable, delay: float) -> None:
        super().__init__(config)
        self._runtime = runtime
        self._delay = delay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    def capture_signals(self) -> AbstractContextManager[None]:  # type: ignore[override]
        # uvicorn's own restores the default disposition and then re-raises the signals it caught, which ends a
        # drained router with the signal's status; router/signals.py keeps them handled, then ignored, to the exit
        return stop_signals_to(self.handle_exit)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled or self._loop is None or self._delay <= 0:
            self._runtime.begin_drain()
            self._stop(sig, frame)
            return
        self._signalled = True
        logger.info("signal %s: draining; closing the listener in %.1f s", sig, self._delay)
        self._loop.call_soon_threadsafe(self._runtime.begin_drain)
        self._loop.call_soon_threadsafe(self._loop.call_later, self._delay, self._stop, sig, frame)

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
