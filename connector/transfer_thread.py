"""The one thread that owns the transfer backend (the NIXL agent) and both rendezvous machines.

Threading model:

* **Owner thread** (``kvpush-transfer``, this module): the only caller of the ``TransferBackend``
  and the only reader/writer of ``PrefillRendezvous`` / ``DecodeRendezvous``, ``_writes``,
  ``_agents`` and ``_links``. Each turn it drains the inbox, polls notices (which also progresses
  UCX, since NIXL runs without its progress thread), checks posted WRITEs, expires leases and
  performs the actions the machines return. It sleeps on ``_wake`` between turns: ``poll_s`` while
  anything is in flight, ``idle_poll_s`` otherwise.
* **Worker thread** (vLLM's model runner, via ``connector.worker``): only calls ``submit`` (puts a
  step order in the inbox and sets ``_wake``) and ``drain`` (empties the outbox). It never waits on
  the owner thread, so the forward loop never waits on NIXL.
* **Side-channel threads** (``connector.handshake``): put ``_PeerReady`` / ``_PeerLost`` /
  ``_AddPeer`` in the inbox. ``_AddPeer`` carries an ``Event`` the server thread waits on, so the
  handshake reply is sent only after the owner loaded the peer's agent. They read only
  ``_local_payload`` (built from bytes cached at start, never a backend call).

Stopping: ``close()`` sets ``_stop`` and ``_wake``, joins the owner thread, then closes the
side channel and the backend from the calling thread (the owner is gone by then).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.handshake import PeerLink, SideChannelServer
from connector.metadata import (
    PROTOCOL_VERSION,
    Cancel,
    Done,
    Failure,
    HandshakePayload,
    KVLayout,
    PeerAddress,
    PrefillFailed,
    PrefillFinished,
    ProtocolError,
    RegisterOrder,
    Registration,
    decode_notice,
    encode_notice,
    is_notice,
)
from connector.rendezvous import (
    P_TERMINAL,
    AbandonWrite,
    Action,
    Connect,
    DecodeRendezvous,
    PrefillRendezvous,
    Received,
    Release,
    Send,
    StartWrite,
    Timeouts,
)
from connector.transfer import TransferBackend, TransferError, WriteTicket

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelOrder:
    """D: vLLM finished ``request_id`` while it still waited for KV."""

    request_id: str


@dataclass(frozen=True)
class _PeerReady:
    payload: HandshakePayload
    clock_offset: float


@dataclass(frozen=True)
class _PeerLost:
    engine_id: str


@dataclass
class _AddPeer:
    payload: HandshakePayload
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


Order = RegisterOrder | PrefillFinished | PrefillFailed | CancelOrder
_Command = Order | _PeerReady | _PeerLost | _AddPeer


@dataclass(frozen=True)
class TransferRecord:
    """One completed WRITE, for statistics."""

    num_bytes: int
    seconds: float
    num_descriptors: int


@dataclass
class Results:
    """What the owner thread reported since the last ``drain``."""

    released: set[str] = field(default_factory=set)  # P: finished sending
    received: set[str] = field(default_factory=set)  # D: finished receiving (ok or not)
    failed: set[str] = field(default_factory=set)  # D: subset of ``received`` without valid KV
    records: list[TransferRecord] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)


class TransferThread:
    def __init__(
        self,
        backend: TransferBackend,
        *,
        engine_id: str,
        layout: KVLayout,
        compat_hash: str,
        side_host: str,
        side_port: int,
        timeouts: Timeouts,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.001,
        idle_poll_s: float = 0.005,
    ) -> None:
        self.engine_id = engine_id
        self._backend = backend
        self._layout = layout
        self._compat_hash = compat_hash
        self._metadata = backend.agent_metadata()
        self._clock = clock
        self._poll_s, self._idle_poll_s = poll_s, idle_poll_s
        self._timeouts = timeouts
        self._prefill = PrefillRendezvous(timeouts)
        self._decode = DecodeRendezvous(timeouts, engine_id)
        self._writes: dict[str, tuple[WriteTicket, float]] = {}
        self._agents: dict[str, str] = {}  # engine id -> agent name
        self._links: dict[str, PeerLink] = {}
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Results] = queue.SimpleQueue()
        self._pending = Results()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._server = SideChannelServer(
            side_host, side_port, self._local_payload, self._add_peer_and_wait, self._peer_lost, compat_hash
        )
        self.side_port = self._server.port
        self._thread = threading.Thread(target=self._run, name="kvpush-transfer", daemon=True)
        self._thread.start()

    # ---- worker-thread API -------------------------------------------------------------

    def submit(self, order: Order) -> None:
        self._inbox.put(order)
        self._wake.set()

    def drain(self) -> Results:
        merged = Results()
        while True:
            try:
                r = self._outbox.get_nowait()
            except queue.Empty:
                return merged
            merged.released |= r.released
            merged.received |= r.received
            merged.failed |= r.failed
            merged.records += r.records
            merged.counters.update(r.counters)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._server.close()
        for link in self._links.values():
            link.close()
        self._backend.close()

    # ---- side-channel callbacks (their own threads) ------------------------------------

    def _local_payload(self) -> HandshakePayload:
        return HandshakePayload(
            PROTOCOL_VERSION,
            self._compat_hash,
            self.engine_id,
            self._backend.agent_name,
            self._metadata,
            self._layout,
            clock=self._clock(),
        )

    def _add_peer_and_wait(self, payload: HandshakePayload) -> None:
        cmd = _AddPeer(payload)
        self._inbox.put(cmd)
        self._wake.set()
        if not cmd.done.wait(timeout=self._timeouts.connect_timeout_s):
            raise TimeoutError("transfer thread did not load the peer in time")
        if cmd.error is not None:
            raise ConnectionError(cmd.error)

    def _peer_lost(self, engine_id: str) -> None:
        self._inbox.put(_PeerLost(engine_id))
        self._wake.set()

    # ---- owner thread --------------------------------------------------------------------

    def _run(self) -> None:
        next_expiry = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            now = self._clock()
            try:
                self._turn(now)
                if now >= next_expiry:
                    self._perform(self._prefill.expire(now), now)
                    self._perform(self._decode.expire(now), now)
                    next_expiry = now + 0.05
            except Exception:  # the loop must survive one bad turn
                logger.exception("kvpush transfer thread turn failed")
                self._pending.counters["thread_errors"] += 1
            self._publish()
            self._wake.wait(self._poll_s if self._busy() else self._idle_poll_s)

    def _turn(self, now: float) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(cmd, now)
        for sender, raw in self._backend.poll_notices():
            self._on_raw_notice(sender, raw, now)
        self._check_writes(now)

    def _busy(self) -> bool:
        return bool(
            self._writes
            or self._decode.entries
            or any(e.state not in P_TERMINAL for e in self._prefill.entries.values())
        )

    def _publish(self) -> None:
        counters = self._prefill.counters + self._decode.counters
        self._pending.counters.update(counters)
        self._prefill.counters.clear()
        self._decode.counters.clear()
        p = self._pending
        if p.released or p.received or p.records or p.counters:
            self._outbox.put(p)
            self._pending = Results()

    def _handle(self, cmd: _Command, now: float) -> None:
        if isinstance(cmd, RegisterOrder):
            self._perform(self._decode.on_register(cmd.request_id, cmd.key, cmd.peer, cmd.block_ids, now), now)
        elif isinstance(cmd, CancelOrder):
            self._perform(self._decode.on_abort(cmd.request_id, now), now)
        elif isinstance(cmd, PrefillFinished):
            self._perform(self._prefill.on_prefill_finished(cmd.key, cmd.request_id, cmd.block_ids, now), now)
        elif isinstance(cmd, PrefillFailed):
            self._perform(self._prefill.on_prefill_failed(cmd.key, cmd.reason, now), now)
        elif isinstance(cmd, _AddPeer):
            try:
                self._load_peer(cmd.payload)
            except TransferError as exc:
                cmd.error = str(exc)
            cmd.done.set()
        elif isinstance(cmd, _PeerReady):
            try:
                self._load_peer(cmd.payload)
            except TransferError:
                logger.exception("could not load prefill agent %s", cmd.payload.engine_id)
                self._perform(self._decode.on_peer_lost(cmd.payload.engine_id, now), now)
                return
            self._perform(self._decode.on_peer_ready(cmd.payload.engine_id, cmd.clock_offset, now), now)
        elif isinstance(cmd, _PeerLost):
            link = self._links.pop(cmd.engine_id, None)
            if link is not None:
                link.close()
            self._perform(self._decode.on_peer_lost(cmd.engine_id, now), now)
            self._perform(self._prefill.on_peer_lost(cmd.engine_id, now), now)

    def _load_peer(self, payload: HandshakePayload) -> None:
        self._backend.add_peer(payload)
        self._agents[payload.engine_id] = payload.agent_name

    def _on_raw_notice(self, sender: str, raw: bytes, now: float) -> None:
        if not is_notice(raw):
            self._pending.counters["unknown_notices"] += 1
            return
        try:
            notice = decode_notice(raw)
        except ProtocolError as exc:
            logger.warning("dropped notice from %s: %s", sender, exc)
            self._pending.counters["bad_notices"] += 1
            return
        if isinstance(notice, Registration):
            self._perform(self._prefill.on_registration(notice, now), now)
        elif isinstance(notice, Cancel):
            self._perform(self._prefill.on_cancel(notice, now), now)
        else:
            self._perform(self._decode.on_notice(notice, now), now)

    def _check_writes(self, now: float) -> None:
        for key, (ticket, started) in list(self._writes.items()):
            state = self._backend.write_state(ticket.handle)
            if state == "PROC":
                continue
            del self._writes[key]
            self._backend.release(ticket.handle)
            if state == "DONE":
                self._pending.records.append(TransferRecord(ticket.num_bytes, now - started, ticket.num_descriptors))
            self._perform(self._prefill.on_write_result(key, state == "DONE", now), now)

    # ---- performing actions --------------------------------------------------------------

    def _perform(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                self._start_write(action, now)
            elif isinstance(action, AbandonWrite):
                entry = self._writes.pop(action.key, None)
                if entry is not None:
                    self._backend.release(entry[0].handle)
            elif isinstance(action, Send):
                self._send(action, now)
            elif isinstance(action, Release):
                self._pending.released.add(action.request_id)
            elif isinstance(action, Received):
                self._pending.received.add(action.request_id)
                if not action.ok:
                    self._pending.failed.add(action.request_id)
            elif isinstance(action, Connect):
                self._connect(action.peer)

    def _start_write(self, action: StartWrite, now: float) -> None:
        reg = action.registration
        try:
            agent = self._agents[reg.d_engine_id]
            done = encode_notice(Done(reg.key, reg.d_request_id))
            ticket = self._backend.write(agent, action.local_blocks, reg.block_ids, done)
        except (KeyError, TransferError, ValueError) as exc:
            logger.warning("WRITE for %s not posted: %r", action.key, exc)
            self._perform(self._prefill.on_write_result(action.key, False, now), now)
            return
        self._writes[action.key] = (ticket, now)

    def _send(self, action: Send, now: float) -> None:
        notice = action.notice
        try:
            self._backend.send_notice(self._agents[action.engine_id], encode_notice(notice))
        except (KeyError, TransferError) as exc:
            logger.warning("%s notice to %s not sent: %r", notice.kind, action.engine_id, exc)
            self._pending.counters["failed_notices"] += 1
            if isinstance(notice, Registration):  # P never saw it: fail just this request
                failure = Failure(notice.key, notice.d_request_id, "registration could not be sent")
                self._perform(self._decode.on_notice(failure, now), now)
            # A lost Cancel keeps the request held until its deadline; a lost Ack, Failure or
            # Done likewise ends at decode's deadline. Safe, only slower.

    def _connect(self, peer: PeerAddress) -> None:
        if peer.engine_id in self._links:
            return
        self._links[peer.engine_id] = PeerLink(
            peer,
            self._local_payload,
            on_ready=lambda payload, offset: self._inbox_put(_PeerReady(payload, offset)),
            on_lost=self._peer_lost,
            expect_hash=self._compat_hash,
            timeout_s=self._timeouts.connect_timeout_s,
        )

    def _inbox_put(self, cmd: _Command) -> None:
        self._inbox.put(cmd)
        self._wake.set()
