"""Side channel: TCP exchange of ``HandshakePayload`` s, kept open as a liveness link.

Threading model:

* ``SideChannelServer`` (the prefill side, but every instance runs one) owns a listener thread
  and one daemon thread per accepted link. A link thread reads the peer's payload, checks version
  and compatibility hash, asks ``on_peer`` (the transfer thread, through its inbox) to load the
  peer's agent and waits for that before replying with the local payload. Only then can the peer
  send notices, so the first one always finds a known agent. The thread then watches the link
  (below) and calls ``on_lost`` when it ends.
* ``PeerLink`` (the decode side) is one daemon thread per prefill instance: connect, exchange
  payloads, report ``on_ready(payload, clock_offset)`` (or ``on_lost`` on any failure), then watch
  the link and report ``on_lost`` when it ends.

Watching a link (guarantee G3): after the handshake both ends send a one-byte heartbeat every
``Liveness.heartbeat_s`` and count the link lost when nothing arrived for ``Liveness.dead_after_s``
(a frozen or silently dead peer: SIGSTOP, a host gone without a FIN), when it closes, or when it
errors. TCP keepalive is on as well, for the kernel's own view of a dead host. A lost link is not
proof that the peer's process is gone; ``connector.rendezvous.prefill`` treats it that way.

No thread here touches NIXL. Frames are a 4-byte big-endian length plus a body; a reply body
starts with ``OK`` (payload follows) or ``ER`` (error text follows). After the handshake only
heartbeat bytes flow.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from connector.wire.metadata import PROTOCOL_VERSION, HandshakePayload, PeerAddress, ProtocolError

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
HEARTBEAT = b"\x00"


@dataclass(frozen=True)
class Liveness:
    """How a side-channel link notices a peer that went away or froze (seconds)."""

    heartbeat_s: float = 1.0  # each end sends a heartbeat this often
    dead_after_s: float = 3.0  # nothing received for this long: the link is lost

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")

    @property
    def bound_s(self) -> float:
        """At most this long from the peer's last byte to ``on_lost``."""
        return self.dead_after_s + self._tick_s

    @property
    def _tick_s(self) -> float:
        return min(self.heartbeat_s, self.dead_after_s / 3)


def enable_keepalive(sock: socket.socket, liveness: Liveness) -> None:
    """TCP keepalive probes after ``dead_after_s`` of silence (where the platform has the knobs)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(liveness.dead_after_s))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def watch_link(sock: socket.socket, liveness: Liveness, clock: Callable[[], float], stopped: threading.Event) -> str:
    """Send heartbeats and read the peer's until the link closes, errors or goes silent (or
    ``stopped`` is set); return why it ended."""
    tick = liveness._tick_s
    sock.settimeout(tick)
    last_rx = last_tx = clock()
    while not stopped.is_set():
        now = clock()
        if now - last_tx >= liveness.heartbeat_s:
            last_tx = now
            try:
                sock.send(HEARTBEAT)
            except TimeoutError:
                pass  # the peer reads nothing (frozen): its silence decides below
            except OSError as exc:
                return f"send failed: {exc}"
        try:
            data = sock.recv(4096)
        except TimeoutError:
            data = None
        except OSError as exc:
            return f"receive failed: {exc}"
        else:
            if not data:
                return "closed by the peer"
            last_rx = clock()
        if clock() - last_rx > liveness.dead_after_s:
            return f"silent for more than {liveness.dead_after_s:g} s"
    return "closed locally"


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if size > MAX_FRAME:
        raise ProtocolError(f"side-channel frame of {size} bytes is too large")
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed")
        buf += chunk
    return bytes(buf)


class SideChannelServer:
    """Answers handshakes with the local payload; reports links that close."""

    def __init__(
        self,
        host: str,
        port: int,
        local_payload: Callable[[], HandshakePayload],
        on_peer: Callable[[HandshakePayload], None],
        on_lost: Callable[[str], None],
        expect_hash: str,
        liveness: Liveness | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._local_payload = local_payload
        self._on_peer = on_peer
        self._on_lost = on_lost
        self._expect_hash = expect_hash
        self._liveness = liveness or Liveness()
        self._clock = clock
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._links: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._per_engine: dict[str, int] = {}  # open links per peer engine id
        self._thread = threading.Thread(target=self._accept_loop, name="kvpush-side-channel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvpush-side-link", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self._links.add(conn)
        try:
            with conn:
                enable_keepalive(conn, self._liveness)
                engine_id = self._answer(conn)
                if engine_id is None:
                    return
                with self._lock:
                    self._per_engine[engine_id] = self._per_engine.get(engine_id, 0) + 1
                why = watch_link(conn, self._liveness, self._clock, self._stopped)
        finally:
            self._links.discard(conn)
        with self._lock:
            left = self._per_engine[engine_id] - 1
            self._per_engine[engine_id] = left
        if not self._stopped.is_set():
            logger.warning("side-channel link of %s lost: %s (%d still open)", engine_id, why, left)
            if left == 0:
                self._on_lost(engine_id)

    def _answer(self, conn: socket.socket) -> str | None:
        """Run the exchange; return the peer's engine id, or None after refusing it."""
        try:
            conn.settimeout(30.0)
            peer = HandshakePayload.decode(recv_frame(conn), expect_hash=self._expect_hash)
            self._on_peer(peer)  # returns once the transfer thread loaded the agent
            send_frame(conn, b"OK" + self._local_payload().encode())
            return peer.peer_key  # one rank of the peer engine
        except (ProtocolError, OSError, ConnectionError, TimeoutError) as exc:
            logger.warning("side-channel handshake refused: %s", exc)
            with contextlib.suppress(OSError):
                send_frame(conn, b"ER" + str(exc).encode())
            return None

    def close(self) -> None:
        """Stop accepting and drop every link (peers see the same end of stream as on exit)."""
        self._stopped.set()
        self._sock.close()
        for conn in list(self._links):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def mismatched_parallelism(payload: HandshakePayload, peer: PeerAddress) -> str:
    """The refusal of a prefill whose TP/PP is not what the decode leg said (a wrong router configuration
    would otherwise make decode wait for too few parts: wrong KV)."""
    return (
        f"prefill {payload.engine_id!r} runs tp_size {payload.rank.tp_size} pp_size {payload.rank.pp_size}, the "
        f"decode leg said tp_size {peer.tp_size} pp_size {peer.pp_size} (check the router's tp/pp for this prefill)"
    )


class PeerLink:
    """Decode's link to one prefill instance (see the module docstring)."""

    def __init__(
        self,
        peer: PeerAddress,
        local_payload: Callable[[], HandshakePayload],
        on_ready: Callable[[HandshakePayload, float], None],
        on_lost: Callable[[str], None],
        expect_hash: str,
        timeout_s: float,
        liveness: Liveness | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peer = peer
        self._local_payload = local_payload
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._expect_hash = expect_hash
        self._timeout_s = timeout_s
        self._liveness = liveness or Liveness()
        self._clock = clock
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-link-{peer.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            payload, offset = self._handshake()
        except (ProtocolError, OSError, ConnectionError, TimeoutError) as exc:
            logger.warning("handshake with %s:%d failed: %s", self.peer.host, self.peer.port, exc)
            self._on_lost(self.peer.key)
            return
        self._on_ready(payload, offset)
        assert self._sock is not None
        why = watch_link(self._sock, self._liveness, self._clock, self._closed)
        if not self._closed.is_set():
            logger.warning("side-channel link to prefill %s lost: %s", self.peer.key, why)
        self._on_lost(self.peer.key)

    def _handshake(self) -> tuple[HandshakePayload, float]:
        sock = socket.create_connection((self.peer.host, self.peer.port), timeout=self._timeout_s)
        self._sock = sock
        enable_keepalive(sock, self._liveness)
        send_frame(sock, self._local_payload().encode())
        reply = recv_frame(sock)
        t1 = self._clock()
        if reply[:2] != b"OK":
            why = reply[2:].decode(errors="replace")  # an older peer's refusal may not name our version
            raise ProtocolError(
                f"peer refused handshake (this connector speaks wire version {PROTOCOL_VERSION}): {why}"
            )
        payload = HandshakePayload.decode(reply[2:], expect_hash=self._expect_hash)
        if payload.engine_id != self.peer.engine_id:
            raise ProtocolError(f"peer is engine {payload.engine_id!r}, request named {self.peer.engine_id!r}")
        if (payload.rank.tp_size, payload.rank.pp_size) != (self.peer.tp_size, self.peer.pp_size):
            raise ProtocolError(mismatched_parallelism(payload, self.peer))
        if payload.rank.rank != self.peer.rank:
            raise ProtocolError(
                f"peer {payload.engine_id!r} answered as rank {payload.rank.rank} on port {self.peer.port}, "
                f"expected rank {self.peer.rank} (side-channel ports: rank-0 port + pp * tp_size + tp)"
            )
        # The peer read its clock before we read t1: (peer - local) >= payload.clock - t1.
        return payload, payload.clock - t1

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()


# --------------------------------------------------------------------------------------------
# The seam: how the transfer thread opens side channels (TCP here; an in-process fake in tests)
# --------------------------------------------------------------------------------------------


class Server(Protocol):
    @property
    def port(self) -> int: ...
    def close(self) -> None: ...


class PeerHandle(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


class SideChannel(Protocol):
    """Opens the listening end and the links to prefills; the callbacks are those of
    ``SideChannelServer`` and ``PeerLink`` and run on the side channel's own threads."""

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
    ) -> Server: ...

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
    ) -> PeerHandle: ...


class TcpSideChannel:
    """The real side channel: ``SideChannelServer`` and ``PeerLink`` over TCP."""

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
    ) -> Server:
        return SideChannelServer(host, port, local_payload, on_peer, on_lost, expect_hash, liveness, clock)

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
    ) -> PeerHandle:
        return PeerLink(peer, local_payload, on_ready, on_lost, expect_hash, timeout_s, liveness, clock)
