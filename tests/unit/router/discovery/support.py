"""Stand-ins shared by the discovery source tests: a recording sink, a scripted sleep, a scripted resolver."""

from __future__ import annotations

from collections.abc import Sequence

from router.domain import Role, WorkerSpec


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[Role, list[str]]] = []

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        self.calls.append((role, [s.url for s in specs]))

    @property
    def urls(self) -> list[list[str]]:
        return [urls for _, urls in self.calls]


class Stop(BaseException):
    """Ends a source's loop in a test. Not an Exception: the sources survive every Exception."""


class Sleeps:
    """Records the delays asked for; ends the source's loop on the `rounds`-th sleep."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) >= self.rounds:
            raise Stop


class ScriptedResolver:
    def __init__(self, *answers: frozenset[str] | Exception) -> None:
        self.answers = list(answers)

    async def addresses(self, name: str) -> frozenset[str]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
