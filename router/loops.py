"""The router's background loops (health, scrape, discovery) kept running: restarted after an error, with backoff.

Each loop handles the failures it expects (a worker that does not answer, a failed discovery round) itself; the
supervisor is the second line, for what nobody expected. It logs every error with its traceback, tells
`on_error` (wired to `kvpush_loop_errors_total{loop}`), and starts the loop again after a doubling delay. A loop
that fails `budget` times in a row, or that returns at all (a loop is meant to run until cancelled), is dead:
`alive()` turns False for good and /ready answers 503, so an orchestrator replaces the router. A loop that ran for
`healthy_after` seconds before failing starts a fresh streak.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.domain import Sleep

logger = logging.getLogger("kvpush.loops")

ErrorHook = Callable[[str, BaseException], None]


class LoopEnded(RuntimeError):
    """A background loop returned instead of running until cancelled."""


@dataclass(frozen=True)
class Restarts:
    """When a failed loop starts again, and when it is given up."""

    backoff: float = 0.5  # seconds before the first restart, doubled per failure in a row
    backoff_max: float = 10.0
    budget: int = 10  # failures in a row before the loop is dead
    healthy_after: float = 60.0  # a run at least this long before failing resets the streak


class Supervisor:
    """Runs named loops as tasks; see the module docstring. Owned by the event loop's thread."""

    def __init__(
        self,
        on_error: ErrorHook,
        *,
        restarts: Restarts | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._on_error = on_error
        self._restarts = restarts or Restarts()
        self._sleep = sleep
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._dead: list[str] = []
        self._stopping = False

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Starts `factory()` as the loop `name` (a fresh awaitable from `factory` at every restart)."""
        if self._stopping:
            raise RuntimeError(f"loop {name!r} spawned after stop()")
        if name in self._tasks:
            raise ValueError(f"a loop named {name!r} is already running")
        self._tasks[name] = asyncio.get_running_loop().create_task(self._supervise(name, factory), name=name)

    def alive(self) -> bool:
        """False once any loop is dead (stays False)."""
        return not self._dead

    @property
    def dead(self) -> tuple[str, ...]:
        """The names of the loops that died, in the order they did."""
        return tuple(self._dead)

    async def stop(self) -> None:
        """Cancels every loop and waits until each has ended."""
        self._stopping = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        clock = self._clock or asyncio.get_running_loop().time
        failures, delay = 0, self._restarts.backoff
        while True:
            started = clock()
            try:
                await factory()
                error: Exception = LoopEnded(f"loop {name!r} returned; it should run until cancelled")
                ended = True
            except Exception as exc:  # noqa: BLE001 - the point of a supervisor: logged, counted, restarted
                error, ended = exc, False
            if clock() - started >= self._restarts.healthy_after:
                failures, delay = 0, self._restarts.backoff
            failures += 1
            self._report(name, error)
            if ended or failures >= self._restarts.budget:
                self._dead.append(name)
                logger.error("background loop %s is dead after %d failure(s) in a row; /ready is 503", name, failures)
                return
            logger.warning("background loop %s restarts in %.2f s (failure %d in a row)", name, delay, failures)
            await self._sleep(delay)
            delay = min(self._restarts.backoff_max, delay * 2)

    def _report(self, name: str, error: Exception) -> None:
        logger.error("background loop %s failed: %s: %s", name, type(error).__name__, error, exc_info=error)
        try:
            self._on_error(name, error)
        except Exception:
            logger.exception("the error hook of background loop %s failed", name)
