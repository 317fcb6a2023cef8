"""The stop signals while the router serves (router/signals.py) and the uvicorn drain's use of them
(router/drain.py): handled inside, ignored after, never the default in between. Signals raised in this process."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest
import uvicorn

from router.drain import DrainingServer
from router.signals import STOP_SIGNALS, stop_signals_to


@pytest.fixture(autouse=True)
def restored_handlers() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_inside_the_handler_gets_both_signals_and_after_both_are_ignored_not_defaulted() -> None:
    seen: list[int] = []

    def handler(sig: int, frame: FrameType | None) -> None:
        seen.append(sig)

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with stop_signals_to(handler):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)
    signal.raise_signal(signal.SIGTERM)  # a late signal: this process goes on
    assert seen == [signal.SIGTERM, signal.SIGINT]


def test_an_error_while_serving_still_leaves_the_signals_ignored() -> None:
    with pytest.raises(RuntimeError), stop_signals_to(lambda sig, frame: None):
        raise RuntimeError("the server failed")
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)


def test_from_another_thread_nothing_is_installed() -> None:
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    during: list[object] = []

    def serve() -> None:
        with stop_signals_to(lambda sig, frame: None):
            during.extend(signal.getsignal(sig) for sig in STOP_SIGNALS)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(10)
    assert during == [before[sig] for sig in STOP_SIGNALS]
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_uvicorn_serving_hands_the_signals_to_the_drain_and_ignores_them_after() -> None:
    class Runtime:
        def begin_drain(self) -> None:
            pass

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not called")

    server = DrainingServer(uvicorn.Config(app), Runtime(), delay=0.0)
    with server.capture_signals():
        assert all(signal.getsignal(sig) == server.handle_exit for sig in STOP_SIGNALS)
        signal.raise_signal(signal.SIGTERM)
        assert server.should_exit
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)
