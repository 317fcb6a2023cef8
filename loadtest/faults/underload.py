"""Item 6 of issue 42: a row's fault injected while other clients keep a steady rate at about 70 % of the bed's
capacity. `capacity` measures the bed first (back-to-back clients for a few seconds); `Load` runs the steady
rate on a thread while the row injects its fault; `judge_load` (pure) says what the other clients got."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loadtest.faults import client

LOAD_FRACTION = 0.7
MIN_SUCCESS = 0.99  # the target for the other clients wherever a healthy engine of the role remains


def capacity(url: str, clients: int = 4, seconds: float = 15.0) -> float:
    """Requests per second `clients` back-to-back clients get through the bed (short completions)."""
    until = time.monotonic() + seconds

    def loop() -> int:
        n = 0
        while time.monotonic() < until:
            client.request(url, client.body(max_tokens=16))
            n += 1
        return n

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(f.result() for f in [pool.submit(loop) for _ in range(clients)])
    return done / (time.monotonic() - t0)


@dataclass
class Load:
    """A steady rate of short completions through `url` for `seconds`, started by `start()`; each request on its
    own thread (a slow answer does not delay the next). `results()` waits for every one of them."""

    url: str
    rate: float
    seconds: float
    make: Callable[[], dict[str, Any]] = client.body
    started: list[tuple[float, Future[client.Result]]] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pool = ThreadPoolExecutor(max(1, int(self.rate * self.seconds) + 1))
        t0 = time.monotonic()
        for i in range(int(self.rate * self.seconds)):
            time.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
            self.started.append((time.monotonic(), pool.submit(client.request, self.url, self.make())))
        pool.shutdown(wait=False)

    def results(self) -> list[tuple[float, client.Result]]:
        assert self._thread is not None
        self._thread.join()
        return [(t, f.result()) for t, f in self.started]


def judge_load(results: list[tuple[float, client.Result]], t_fault: float, settle_s: float) -> tuple[float, float, str]:
    """Pure: the other clients' success rate over the whole load and over the requests that started `settle_s`
    after the fault (once the router can have held the faulty engine out), and a note."""

    def rate(rs: list[client.Result]) -> float:
        return sum(1 for r in rs if r.status == 200 and r.complete) / len(rs) if rs else 1.0

    every = [r for _, r in results]
    later = [r for t, r in results if t >= t_fault + settle_s]
    note = (
        f"other clients: {client.summary(every) or 'none'}; served {rate(every):.1%} of {len(every)}, "
        f"{rate(later):.1%} of the {len(later)} started {settle_s:g} s after the fault"
    )
    return rate(every), rate(later), note
