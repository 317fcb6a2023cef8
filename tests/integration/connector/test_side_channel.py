"""The side channel between two real processes on loopback: a frozen or silently dead peer is noticed.

The prefill side is a child process running only ``SideChannelServer`` (no NIXL); the test process is
the decode side with a ``PeerLink``. Guarantee G3 of connector/README.md: a peer that stops answering
(SIGSTOP: the kernel still ACKs, so TCP alone never notices) is reported lost within
``Liveness.bound_s``, and so is one that exits.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload, KVLayout, PeerAddress, Region
from connector.wire.side_channel import Liveness, PeerLink

pytestmark = pytest.mark.integration

LIVENESS = Liveness(heartbeat_s=0.2, dead_after_s=1.0)
LAYOUT = KVLayout("DRAM", 0, 16, (Region(4096, 64, 4),))


def payload(engine: str) -> HandshakePayload:
    return HandshakePayload(PROTOCOL_VERSION, "it", engine, f"agent-{engine}", b"meta", LAYOUT, time.monotonic())


def server_main(conn: Connection) -> None:
    from connector.wire.side_channel import SideChannelServer

    server = SideChannelServer(
        "127.0.0.1", 0, lambda: payload("P"), lambda peer: None, lambda engine: None, "it", liveness=LIVENESS
    )
    conn.send(server.port)
    conn.recv()  # until the test says stop


@pytest.fixture
def prefill() -> Iterator[tuple[Any, int]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server_main, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60), "side-channel server did not start"
    port: int = parent.recv()
    yield proc, port
    if proc.pid is not None and proc.is_alive():
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.join(10)


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def link_to(port: int) -> tuple[PeerLink, threading.Event, threading.Event]:
    ready, lost = threading.Event(), threading.Event()
    link = PeerLink(
        PeerAddress("P", "127.0.0.1", port),
        lambda: payload("D"),
        on_ready=lambda p, offset: ready.set(),
        on_lost=lambda engine: lost.set(),
        expect_hash="it",
        timeout_s=5.0,
        liveness=LIVENESS,
    )
    link.start()
    return link, ready, lost


@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_a_frozen_or_dead_peer_is_noticed_within_the_liveness_bound(prefill: tuple[Any, int], how: str) -> None:
    proc, port = prefill
    link, ready, lost = link_to(port)
    try:
        assert ready.wait(10), "handshake did not complete"
        assert not wait_for(lost.is_set, 3 * LIVENESS.dead_after_s), "a live, answering peer was reported lost"
        os.kill(proc.pid, signal.SIGSTOP if how == "sigstop" else signal.SIGKILL)
        assert wait_for(lost.is_set, LIVENESS.bound_s + 5.0), f"{how}: the peer was never reported lost"
    finally:
        link.close()


def test_a_peer_of_the_old_wire_version_is_refused_at_the_handshake_naming_both_versions(
    prefill: tuple[Any, int], caplog: pytest.LogCaptureFixture
) -> None:
    """G9: the decode side speaks version N-1 to a real server of version N; the refusal names both."""
    _, port = prefill
    lost = threading.Event()
    old = dataclasses.replace(payload("D"), protocol_version=PROTOCOL_VERSION - 1)
    link = PeerLink(
        PeerAddress("P", "127.0.0.1", port),
        lambda: old,
        on_ready=lambda p, offset: None,
        on_lost=lambda engine: lost.set(),
        expect_hash="it",
        timeout_s=5.0,
        liveness=LIVENESS,
    )
    with caplog.at_level(logging.WARNING, logger="connector.wire.side_channel"):
        link.start()
        try:
            assert lost.wait(10), "the refused handshake was not reported"
        finally:
            link.close()
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert f"the peer speaks kvpush wire protocol version {PROTOCOL_VERSION - 1}" in line, line
    assert f"this connector speaks version {PROTOCOL_VERSION}" in line, line


def test_a_prefill_whose_tp_is_not_what_the_decode_leg_said_is_refused_at_the_handshake(
    prefill: tuple[Any, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The server is a TP = 1 prefill; the decode leg claims tp_size 2 (a wrong router configuration)."""
    _, port = prefill
    ready, lost = threading.Event(), threading.Event()
    link = PeerLink(
        PeerAddress("P", "127.0.0.1", port, tp_size=2),
        lambda: payload("D"),
        on_ready=lambda p, offset: ready.set(),
        on_lost=lambda engine: lost.set(),
        expect_hash="it",
        timeout_s=5.0,
        liveness=LIVENESS,
    )
    with caplog.at_level("WARNING"):
        link.start()
        assert wait_for(lost.is_set, 10.0), "refused: reported lost"
    link.close()
    assert not ready.is_set()
    assert "runs tp_size 1 pp_size 1, the decode leg said tp_size 2" in caplog.text
