"""The virtual pair's network on its event clock: transfers sent at a time, a callback where each one lands.

`FifoNet` reserves the link's calendar at once (one transfer at a time, the seed-scale model); `SharedNet`
runs a `link.FairShare` on the clock: a transfer joins after `start_s` (TCP's round trip and slow start,
`link.tcp_start_s`), shares the rate with every other in flight, and its end is settled as the clock reaches
it (a transfer joining earlier moves every end, so stale wake-ups are dropped by generation).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loadtest.sim.link import FairShare, Fifo

Done = Callable[[], None] | None


class At(Protocol):
    now: float

    def at(self, t: float, fn: Callable[[], None]) -> None: ...


class Net(Protocol):
    def send(self, at: float, seconds: float, on_done: Done) -> None: ...


@dataclass
class FifoNet:
    clock: At
    link: Fifo = field(default_factory=Fifo)

    def send(self, at: float, seconds: float, on_done: Done) -> None:
        end = self.link.reserve(at, seconds)
        if on_done is not None:
            self.clock.at(end, on_done)


@dataclass
class SharedNet:
    clock: At
    start_s: float = 0.0
    link: FairShare = field(default_factory=FairShare)
    _waiting: dict[int, Done] = field(default_factory=dict)
    _generation: int = 0

    def send(self, at: float, seconds: float, on_done: Done) -> None:
        self.clock.at(at + self.start_s, lambda: self._join(seconds, on_done))

    def _join(self, seconds: float, on_done: Done) -> None:
        self._waiting[self.link.add(self.clock.now, seconds)] = on_done
        self._settle()

    def _settle(self) -> None:
        for tid, _ in self.link.drain():
            if (fn := self._waiting.pop(tid)) is not None:
                fn()
        self._generation += 1
        generation, end = self._generation, self.link.next_finish()
        if end is not None:
            self.clock.at(end, lambda: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation == self._generation:
            self.link.advance(self.clock.now)
            self._settle()
