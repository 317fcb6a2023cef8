"""The async driver of an Engine: plan a step, wait its duration on the injected sleep, apply it, repeat."""

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from loadtest.sim.engine import Engine, Event

Sleep = Callable[[float], Awaitable[None]]


class EngineLoop:
    """Owns the stepping of one Engine. `poke()` after any outside change (new request, landed KV)."""

    def __init__(self, engine: Engine, sleep: Sleep, on_events: Callable[[Sequence[Event]], None]):
        self.engine = engine
        self.steps = 0
        self.busy_s = 0.0
        self._sleep = sleep
        self._on_events = on_events
        self._wake = asyncio.Event()

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            step = self.engine.plan()
            if step is None:
                self._wake.clear()  # no await since plan(): a poke after this line is never lost
                await self._wake.wait()
                continue
            await self._sleep(step.duration)
            self.steps += 1
            self.busy_s += step.duration
            self._on_events(self.engine.complete(step))
