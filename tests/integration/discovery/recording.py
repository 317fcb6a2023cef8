"""A sink that records every membership it is given, and a bounded wait for a condition on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from router.domain import Role, WorkerSpec


class RecordingSink:
    def __init__(self) -> None:
        self.history: list[tuple[Role, tuple[WorkerSpec, ...]]] = []

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        self.history.append((role, tuple(specs)))

    @property
    def urls(self) -> list[str] | None:
        """The latest membership's URLs; None before the first."""
        return [s.url for s in self.history[-1][1]] if self.history else None

    def seen(self) -> list[list[str]]:
        return [[s.url for s in specs] for _, specs in self.history]


async def until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Polls `condition` until it holds; fails with `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
