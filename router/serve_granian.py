"""The router behind granian (`server: granian`; uvicorn is the default, router/cli.py serve).

The same ASGI app (router.app.create_app) runs in granian's embedded server: one worker inside this process,
on this process's event loop (uvloop), HTTP/1.1 only, access log off, granian's own log lines at the router's
level through the router's handler. Granian runs the app's lifespan (the service starts and stops there).

Drain on SIGTERM/SIGINT, as router/drain.py does for uvicorn: /ready goes 503 at once (`begin_drain`), the
listener closes `drain_delay` seconds later (granian's stop: new connections are refused; the requests in flight
go on and granian waits for them before the lifespan's shutdown), requests still running `drain_grace` seconds
after the listener closed are cancelled here (`InFlight`: granian itself would wait for ever), which closes both
upstream legs; then the process exits 0. A second signal skips the delay.

What differs from uvicorn: granian's embedded mode is marked experimental by granian (it logs so at start);
granian hands the app at most `backpressure` requests at once and stops reading beyond them, set above what the
app's admission lets in (max_in_flight + admission_queue + 64), so the 429s still come from the app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from granian.constants import HTTPModes, Interfaces
from granian.log import LogLevels
from granian.server.embed import Server

from router.config import Settings
from router.signals import stop_signals_to

if TYPE_CHECKING:
    from router.drain import Drainable  # the protocol only: router.drain loads uvicorn

logger = logging.getLogger("kvpush.drain")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Stoppable(Protocol):
    def stop(self) -> None: ...


class Handle(Protocol):
    def cancel(self) -> None: ...


Later = Callable[[float, Callable[[], None]], Handle]  # loop.call_later: the drain's clock seam


class InFlight:
    """The app, with the tasks of the HTTP requests running in it known, so a drain can cancel those that outlive
    the grace (granian runs each request in its own asyncio task)."""

    def __init__(self, app: AsgiApp) -> None:
        self._app = app
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task() if scope["type"] == "http" else None
        if task is None:
            await self._app(scope, receive, send)
            return
        self._tasks.add(task)
        try:
            await self._app(scope, receive, send)
        finally:
            self._tasks.discard(task)

    @property
    def running(self) -> int:
        return len(self._tasks)

    def cancel_all(self) -> int:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)


class GranianDrain:
    """Signals in, the drain's steps out: begin_drain, stop after the delay, cancel what outlives the grace."""

    def __init__(
        self,
        server: Stoppable,
        runtime: Drainable,
        requests: InFlight,
        later: Later,
        delay: float,
        grace: float,
    ) -> None:
        self._server, self._runtime, self._requests, self._later = server, runtime, requests, later
        self._delay, self._grace = delay, grace
        self._signalled = False
        self._closed = False
        self._pending: Handle | None = None

    def on_signal(self, sig: int) -> None:
        self._runtime.begin_drain()
        if self._signalled or self._delay <= 0:
            self._close()
            return
        self._signalled = True
        logger.info("signal %s: draining; closing the listener in %.1f s", sig, self._delay)
        self._pending = self._later(self._delay, self._close)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()
        logger.info("listener closed; %d request(s) in flight get %.1f s", self._requests.running, self._grace)
        self._server.stop()
        self._pending = self._later(self._grace, self._give_up)

    def _give_up(self) -> None:
        if cancelled := self._requests.cancel_all():
            logger.warning("drain grace over: %d request(s) cancelled", cancelled)

    def done(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


def granian_server(app: AsgiApp, settings: Settings) -> Server:
    """granian's embedded server for `app`: one worker on the caller's loop, as the settings say."""
    return Server(
        app,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,  # with the lifespan: the app's service starts and stops there
        http=HTTPModes.http1,
        websockets=False,
        backlog=2048,  # uvicorn's default: a burst of connections is not held in SYN retries
        # requests granian hands the app at once; beyond them it stops reading. The app's admission answers
        # 429 past max_in_flight + admission_queue, so granian must let that many through, plus room for probes.
        backpressure=settings.max_in_flight + settings.admission_queue + 64,
        log_level=LogLevels(settings.log_level),
        log_dictconfig={"loggers": {"_granian": {"propagate": True}}},  # to the router's handler (router/logs.py)
        log_access=False,
    )


async def serve_async(app: AsgiApp, runtime: Drainable, settings: Settings) -> None:
    requests = InFlight(app)
    server = granian_server(requests, settings)
    loop = asyncio.get_running_loop()
    drain = GranianDrain(server, runtime, requests, loop.call_later, settings.drain_delay, settings.drain_grace)
    # signal.signal, not loop.add_signal_handler: removing the loop's handler restores the default disposition,
    # and a signal in the exit would then end a drained router with -15 (router/signals.py)

    def on_signal(sig: int, frame: object) -> None:  # in the main thread, between two steps of the loop
        loop.call_soon_threadsafe(drain.on_signal, sig)

    with stop_signals_to(on_signal):
        try:
            await server.serve()
        finally:
            drain.done()


def serve(app: AsgiApp, runtime: Drainable, settings: Settings) -> None:
    """Serve until drained (router/cli.py serve, `server: granian`)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve_async(app, runtime, settings))
