"""The async driver of an EngineModel: plan a step, wait its duration on the injected sleep, apply it, repeat."""

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from loadtest.sim.engine import EngineModel, Event

Sleep = Callable[[float], Awaitable[None]]


class EngineLoop:
    """Owns the stepping of one EngineModel. `poke()` after any outside change (new request, landed KV).

    Steps follow a modeled timeline: back-to-back steps are timed from the previous step's modeled end, so the
    time spent handling events (and sleep overshoot) is caught up by the next sleep instead of piling up, up to
    CATCH_UP_S behind. `lag_s` adds up how far behind the timeline each step still finished; a simulator is only
    as good as lag_s is small next to busy_s (the modeled time).
    """

    CATCH_UP_S = 0.005

    def __init__(
        self,
        engine: EngineModel,
        sleep: Sleep,
        on_events: Callable[[Sequence[Event]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        self.steps = 0
        self.busy_s = 0.0
        self.lag_s = 0.0
        self._clock = clock
        self._sleep = sleep
        self._on_events = on_events
        self._wake = asyncio.Event()
        self._mark: float | None = None  # modeled end of the previous step; None after an idle wait

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            step = self.engine.plan()
            if step is None:
                self._wake.clear()  # no await since plan(): a poke after this line is never lost
                self._mark = None
                await self._wake.wait()
                continue
            now = self._clock()
            start = now if self._mark is None else max(self._mark, now - self.CATCH_UP_S)
            deadline = start + step.duration
            await self._sleep(max(deadline - now, 0.0))
            self._mark = deadline
            self.steps += 1
            self.busy_s += step.duration
            self._on_events(self.engine.complete(step))
            self.lag_s += max(self._clock() - deadline, 0.0)
