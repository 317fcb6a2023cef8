"""A scenario waits for its victim to hold a request only while there is a request left to catch (no sockets)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, cast

from loadtest.faults import client, scenarios
from loadtest.faults.bed import EngineState, Worker


class Victim:
    """A worker that says it runs something from its `busy_after`-th look on; counts the looks."""

    def __init__(self, busy_after: int) -> None:
        self.looks = 0
        self.busy_after = busy_after

    def state(self, http: Any) -> EngineState:
        self.looks += 1
        return EngineState(True, 1.0 if self.looks >= self.busy_after else 0.0, 0.0)


def answered() -> Future[client.Result]:
    done: Future[client.Result] = Future()
    done.set_result(cast(client.Result, None))
    return done


def test_it_waits_until_the_victim_holds_a_request_while_a_client_waits() -> None:
    victim = Victim(busy_after=3)
    scenarios._wait_running(cast(Worker, victim), [answered(), Future()], timeout=600.0)
    assert victim.looks == 3


def test_it_does_not_wait_once_every_client_has_its_answer() -> None:
    victim = Victim(busy_after=10**9)
    scenarios._wait_running(cast(Worker, victim), [answered(), answered()], timeout=600.0)
    assert victim.looks == 0
