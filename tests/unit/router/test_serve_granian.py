"""The `server` setting (router/config.py, router/cli.py) and granian's drain steps (router/serve_granian.py),
with fakes for the server, the runtime and the clock (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.cli import load_serve_settings
from router.config import Settings, build_settings
from router.errors import ConfigError
from router.serve_granian import GranianDrain, InFlight, Receive, Scope, Send, granian_server

MIN = {"prefill": ["http://p:8100"], "decode": ["http://d:8200"]}


def test_the_server_comes_from_the_file_the_environment_or_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    assert build_settings(MIN).server == "uvicorn"
    config.write_text("prefill: [http://p:8100]\ndecode: [http://d:8200]\nserver: granian\n")
    assert load_serve_settings(["--config", str(config)], {}).server == "granian"
    assert load_serve_settings(["--config", str(config)], {"KVPUSH_SERVER": "uvicorn"}).server == "uvicorn"
    flags = ["--config", str(config), "--server", "granian"]
    assert load_serve_settings(flags, {"KVPUSH_SERVER": "uvicorn"}).server == "granian"
    assert build_settings(MIN, {"server": "GRANIAN"}).server == "granian"


@pytest.mark.parametrize("value", ["hypercorn", "", 1, ["granian"]])
def test_an_unknown_server_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="server: expected one of granian, uvicorn"):
        build_settings(MIN, {"server": value})


def test_the_server_flag_takes_only_known_servers() -> None:
    with pytest.raises(SystemExit):
        load_serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2", "--server", "hypercorn"], {})


def test_granian_lets_through_every_request_the_admission_may_hold() -> None:
    settings = Settings(max_in_flight=100, admission_queue=20, log_level="warning")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not called")

    server = granian_server(app, settings)
    assert server.backpressure == 184 and server.log_access is False


class Clock:
    """call_later, run by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[list[Any]] = []  # [due, callback, cancelled]

    def later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer([self.now + delay, callback, False])
        self.timers.append(timer.entry)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while due := [t for t in self.timers if not t[2] and t[0] <= self.now]:
            entry = min(due, key=lambda t: float(t[0]))
            entry[2] = True
            entry[1]()


class Timer:
    def __init__(self, entry: list[Any]) -> None:
        self.entry = entry

    def cancel(self) -> None:
        self.entry[2] = True


class Events:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def begin_drain(self) -> None:
        self.seen.append("drain")

    def stop(self) -> None:
        self.seen.append("stop")


class Requests(InFlight):
    def __init__(self, events: Events) -> None:
        self.events = events
        self.left = 0

    @property
    def running(self) -> int:
        return self.left

    def cancel_all(self) -> int:
        self.events.seen.append(f"cancel {self.left}")
        return self.left


def drain(delay: float, grace: float) -> tuple[GranianDrain, Events, Clock, Requests]:
    events, clock = Events(), Clock()
    requests = Requests(events)
    return GranianDrain(events, events, requests, clock.later, delay, grace), events, clock, requests


def test_a_signal_drains_at_once_closes_the_listener_after_the_delay_and_cancels_after_the_grace() -> None:
    d, events, clock, requests = drain(delay=3.0, grace=30.0)
    requests.left = 2
    d.on_signal(15)
    assert events.seen == ["drain"]
    clock.advance(2.9)
    assert events.seen == ["drain"]
    clock.advance(0.1)
    assert events.seen == ["drain", "stop"]
    clock.advance(29.9)
    assert events.seen == ["drain", "stop"]
    clock.advance(0.1)
    assert events.seen == ["drain", "stop", "cancel 2"]


def test_a_second_signal_skips_the_delay_and_stops_once() -> None:
    d, events, clock, _ = drain(delay=3.0, grace=30.0)
    d.on_signal(15)
    d.on_signal(15)
    assert events.seen == ["drain", "drain", "stop"]
    clock.advance(3.0)
    d.on_signal(2)
    assert events.seen == ["drain", "drain", "stop", "drain"]


def test_no_delay_stops_at_once_and_a_finished_serve_cancels_nothing() -> None:
    d, events, clock, _ = drain(delay=0.0, grace=1.0)
    d.on_signal(15)
    assert events.seen == ["drain", "stop"]
    d.done()  # granian returned: every request ended within the grace
    clock.advance(5.0)
    assert events.seen == ["drain", "stop"]


def test_in_flight_knows_the_running_http_requests_and_cancels_them() -> None:
    gate = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await gate.wait()

    async def nothing() -> dict[str, Any]:
        return {}

    async def ignore(message: Any) -> None:
        return None

    async def scenario() -> tuple[int, int, int, bool]:
        requests = InFlight(app)
        http = asyncio.create_task(requests({"type": "http"}, nothing, ignore))
        lifespan = asyncio.create_task(requests({"type": "lifespan"}, nothing, ignore))
        await asyncio.sleep(0)
        running = requests.running
        cancelled = requests.cancel_all()
        await asyncio.gather(http, return_exceptions=True)
        gate.set()
        await lifespan
        return running, cancelled, requests.running, http.cancelled()

    assert asyncio.run(scenario()) == (1, 1, 0, True)
