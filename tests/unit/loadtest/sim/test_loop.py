import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from loadtest.sim import costs
from loadtest.sim.engine import EngineModel, Event, LegKind, Req, Token
from loadtest.sim.loop import EngineLoop
from loadtest.sim.profile import load

QWEN = load("qwen3-32b-h200")


def test_back_to_back_steps_catch_up_the_time_spent_handling_events() -> None:
    now = [0.0]
    slept: list[float] = []
    tokens: list[Event] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s
        await asyncio.sleep(0)

    def on_events(events: Sequence[Event]) -> None:
        now[0] += 0.002  # handling a step's events costs 2 ms of real time
        tokens.extend(e for e in events if isinstance(e, Token))
        if any(isinstance(e, Token) and e.final for e in events):
            finished.set()

    finished = asyncio.Event()

    async def go() -> EngineLoop:
        eng = EngineModel(dataclasses.replace(QWEN, step_overhead_s=0.010))
        loop = EngineLoop(eng, sleep, on_events, clock=lambda: now[0])
        eng.add(Req("a", LegKind.LOCAL, prompt=8, max_tokens=4))
        task = asyncio.ensure_future(loop.run())
        await finished.wait()
        task.cancel()
        return loop

    loop = asyncio.run(go())
    step = costs.step_time(QWEN, [], [9]) - QWEN.step_overhead_s + 0.010
    assert slept[0] == pytest.approx(costs.step_time(QWEN, [(8, 0)], []) - QWEN.step_overhead_s + 0.010)
    assert slept[1] == pytest.approx(step - 0.002)  # the 2 ms of handling came out of the next sleep
    assert loop.steps == 4
    assert loop.lag_s == pytest.approx(4 * 0.002)  # each step still ends 2 ms after its modeled end
