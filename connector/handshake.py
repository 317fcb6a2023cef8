"""Side channel: TCP exchange of ``HandshakePayload`` s, kept open as a liveness link.

Threading model:

* ``SideChannelServer`` (the prefill side, but every instance runs one) owns a listener thread
  and one daemon thread per accepted link. A link thread reads the peer's payload, checks version
  and compatibility hash, asks ``on_peer`` (the transfer thread, through its inbox) to load the
  peer's agent and waits for that before replying with the local payload. Only then can the peer
  send notices, so the first one always finds a known agent. The thread then blocks reading the
  socket; end of stream means the peer's process is gone and ``on_lost`` is called.
* ``PeerLink`` (the decode side) is one daemon thread per prefill instance: connect, exchange
  payloads, report ``on_ready(payload, clock_offset)`` (or ``on_lost`` on any failure), then block
  on the socket until the peer goes away and report ``on_lost``.

No thread here touches NIXL. Frames are a 4-byte big-endian length plus a body; a reply body
starts with ``OK`` (payload follows) or ``ER`` (error text follows).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from connector.metadata import HandshakePayload, PeerAddress, ProtocolError

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 20


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


def _wait_closed(sock: socket.socket) -> None:
    """Block until the peer closes the link (or it errors)."""
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


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
    ) -> None:
        self._local_payload = local_payload
        self._on_peer = on_peer
        self._on_lost = on_lost
        self._expect_hash = expect_hash
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._links: set[socket.socket] = set()
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
                engine_id = self._answer(conn)
                if engine_id is None:
                    return
                conn.settimeout(None)
                _wait_closed(conn)
        finally:
            self._links.discard(conn)
        if not self._stopped.is_set():
            self._on_lost(engine_id)

    def _answer(self, conn: socket.socket) -> str | None:
        """Run the exchange; return the peer's engine id, or None after refusing it."""
        try:
            conn.settimeout(30.0)
            peer = HandshakePayload.decode(recv_frame(conn), expect_hash=self._expect_hash)
            self._on_peer(peer)  # returns once the transfer thread loaded the agent
            send_frame(conn, b"OK" + self._local_payload().encode())
            return peer.engine_id
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
    ) -> None:
        self.peer = peer
        self._local_payload = local_payload
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._expect_hash = expect_hash
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-link-{peer.engine_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            payload, offset = self._handshake()
        except (ProtocolError, OSError, ConnectionError, TimeoutError) as exc:
            logger.warning("handshake with %s:%d failed: %s", self.peer.host, self.peer.port, exc)
            self._on_lost(self.peer.engine_id)
            return
        self._on_ready(payload, offset)
        assert self._sock is not None
        _wait_closed(self._sock)
        if not self._closed.is_set():
            logger.warning("prefill %s closed its side channel", self.peer.engine_id)
        self._on_lost(self.peer.engine_id)

    def _handshake(self) -> tuple[HandshakePayload, float]:
        sock = socket.create_connection((self.peer.host, self.peer.port), timeout=self._timeout_s)
        self._sock = sock
        send_frame(sock, self._local_payload().encode())
        reply = recv_frame(sock)
        t1 = time.monotonic()
        if reply[:2] != b"OK":
            raise ProtocolError(f"peer refused handshake: {reply[2:].decode(errors='replace')}")
        payload = HandshakePayload.decode(reply[2:], expect_hash=self._expect_hash)
        if payload.engine_id != self.peer.engine_id:
            raise ProtocolError(f"peer is engine {payload.engine_id!r}, request named {self.peer.engine_id!r}")
        sock.settimeout(None)
        # The peer read its clock before we read t1: (peer - local) >= payload.clock - t1.
        return payload, payload.clock - t1

    def close(self) -> None:
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
