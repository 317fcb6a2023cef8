"""An in-process ``SideChannel`` for the transfer-thread unit tests: no sockets.

Servers are found by a made-up port; ``connect`` runs the same exchange as the TCP side channel (version
and compatibility hash checked, the server's ``on_peer`` called before the reply, the clock sample
returned) on a short-lived thread, and a link can be reset while both ends live. A frozen peer is not
modelled here: tests/integration/connector/test_side_channel.py covers the heartbeats on real sockets.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.wire.metadata import HandshakePayload, PeerAddress
from connector.wire.side_channel import Liveness

_ports = itertools.count(41000)


@dataclass
class _Server:
    channel: LoopbackSideChannel
    port: int
    local_payload: Callable[[], HandshakePayload]
    on_peer: Callable[[HandshakePayload], None]
    on_lost: Callable[[str], None]
    expect_hash: str
    links: list[_Link] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for link in list(self.links):
            link.lose()

    def link_ended(self, link: _Link, engine_id: str) -> None:
        with self.channel.lock:
            if link in self.links:
                self.links.remove(link)
            last = not any(other.engine_id == engine_id for other in self.links)
        if last and not self.closed:
            self.on_lost(engine_id)


@dataclass(eq=False)
class _Link:
    channel: LoopbackSideChannel
    peer: PeerAddress
    local_payload: Callable[[], HandshakePayload]
    on_ready: Callable[[HandshakePayload, float], None]
    on_lost: Callable[[str], None]
    expect_hash: str
    clock: Callable[[], float]
    engine_id: str = ""
    server: _Server | None = None
    ended: bool = False

    def start(self) -> None:
        threading.Thread(target=self._handshake, name="fake-side-link", daemon=True).start()

    def _handshake(self) -> None:
        server = self.channel.servers.get(self.peer.port)
        mine = self.local_payload()
        self.engine_id = mine.peer_key
        if server is None or server.closed or mine.compat_hash != server.expect_hash:
            self._end()
            return
        try:
            server.on_peer(mine)
        except (ConnectionError, TimeoutError):
            self._end()
            return
        theirs = server.local_payload()
        if (
            theirs.compat_hash != self.expect_hash
            or theirs.engine_id != self.peer.engine_id
            or theirs.rank.rank != self.peer.rank
            or (theirs.rank.tp_size, theirs.rank.pp_size) != (self.peer.tp_size, self.peer.pp_size)
        ):
            self._end()
            return
        with self.channel.lock:
            self.server = server
            server.links.append(self)
        self.on_ready(theirs, theirs.clock - self.clock())

    def lose(self) -> None:
        """The link breaks (both processes live on): each end reports it lost."""
        server = self.server
        if self._end() and server is not None:
            server.link_ended(self, self.engine_id)

    def _end(self) -> bool:
        with self.channel.lock:
            if self.ended:
                return False
            self.ended = True
        self.on_lost(self.peer.key)
        return True

    def close(self) -> None:
        self.lose()


class LoopbackSideChannel:
    def __init__(self) -> None:
        self.servers: dict[int, _Server] = {}
        self.lock = threading.Lock()

    def serve(
        self,
        host: str,
        port: int,
        local_payload: Callable[[], HandshakePayload],
        on_peer: Callable[[HandshakePayload], None],
        on_lost: Callable[[str], None],
        expect_hash: str,
        liveness: Liveness,
        clock: Callable[[], float],
    ) -> _Server:
        server = _Server(self, port or next(_ports), local_payload, on_peer, on_lost, expect_hash)
        self.servers[server.port] = server
        return server

    def connect(
        self,
        peer: PeerAddress,
        local_payload: Callable[[], HandshakePayload],
        on_ready: Callable[[HandshakePayload, float], None],
        on_lost: Callable[[str], None],
        expect_hash: str,
        timeout_s: float,
        liveness: Liveness,
        clock: Callable[[], float],
    ) -> _Link:
        return _Link(self, peer, local_payload, on_ready, on_lost, expect_hash, clock)

    def reset(self, port: int) -> None:
        """Break every link to the server on ``port`` while both ends live (a middlebox, a reset)."""
        server = self.servers[port]
        for link in list(server.links):
            link.lose()
