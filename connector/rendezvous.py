"""Pure rendezvous state machines: one per transfer on the prefill side, one per request on decode.

No vLLM, NIXL, torch or threading here. The transfer thread feeds events (each takes ``now``,
the caller's monotonic clock) and performs the returned actions; tests drive the machines
directly. Both machines hold every entry under a deadline, so ``expire(now)`` eventually
removes everything (guarantee 5).

Prefill side, per pairing key (``PrefillRendezvous``)::

    (none) --finished--> AWAIT_REGISTRATION --registration--> WRITING --write ok/failed--> DONE
    (none) --registration--> AWAIT_PREFILL --finished--> WRITING
    (none) --failed--> FAILED (tombstone: a late registration is answered with a Failure)
    (none) / AWAIT_* --cancel--> CANCELLED (tombstone: acked; a late registration/finish is refused)
    WRITING --cancel--> WRITING(cancel pending): the ack waits until the WRITE is DONE or failed
    AWAIT_REGISTRATION / AWAIT_PREFILL --deadline--> DONE (expired; blocks released / D told)
    WRITING --deadline--> DONE (write abandoned, D told)
    DONE / FAILED / CANCELLED --deadline--> removed

Decode side, per D request id (``DecodeRendezvous``)::

    (none) --register--> PENDING_SEND (no connection to P yet) --peer ready--> AWAITING_KV
    (none) --register, peer ready--> AWAITING_KV
    AWAITING_KV --done--> received;  --failure / deadline / peer lost--> received with error
    AWAITING_KV --abort--> CANCELLING --ack / done / failure / deadline / peer lost--> released
    PENDING_SEND --abort--> released at once (P never saw the blocks)

The safety argument for guarantee 2 ("never a write into freed blocks"): D reports an aborted
request (which lets vLLM free its blocks) only after P's ``CancelAck``, ``Done`` or ``Failure``,
after P's process is gone, or after the hold deadline. P acks only when no WRITE is in flight,
and refuses any later WRITE for that key; P never posts a WRITE after the registration's
``write_deadline``, which D places ``write_grace_s`` before its hold deadline, and abandons a
WRITE that runs longer than ``write_timeout_s`` (< ``write_grace_s``).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from connector.metadata import (
    Cancel,
    CancelAck,
    Done,
    Failure,
    Notice,
    PeerAddress,
    Registration,
)


@dataclass(frozen=True)
class Timeouts:
    """Every lease of the protocol, in seconds."""

    lease_s: float = 30.0  # P: finished blocks wait this long for a registration; tombstones live this long
    kv_timeout_s: float = 120.0  # D: how long a registered request waits for its KV
    write_grace_s: float = 10.0  # D: P's last WRITE may start this long before D's hold deadline
    write_timeout_s: float = 5.0  # P: a WRITE still running after this is abandoned (< write_grace_s)
    connect_timeout_s: float = 10.0  # D: handshake with P must finish within this

    def __post_init__(self) -> None:
        if not 0 < self.write_timeout_s < self.write_grace_s < self.kv_timeout_s:
            raise ValueError("need 0 < write_timeout_s < write_grace_s < kv_timeout_s")


# --------------------------------------------------------------------------------------------
# Actions (what the caller must do)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWrite:
    """P: WRITE ``local_blocks`` (tail-aligned) into the registration's blocks, notice ``Done``."""

    key: str
    request_id: str
    local_blocks: tuple[int, ...]
    registration: Registration


@dataclass(frozen=True)
class AbandonWrite:
    """P: release the WRITE of ``key`` still in flight (it ran past ``write_timeout_s``)."""

    key: str


@dataclass(frozen=True)
class Send:
    """Send ``notice`` to the agent of engine ``engine_id``."""

    engine_id: str
    notice: Notice


@dataclass(frozen=True)
class Release:
    """P: the blocks of prefill ``request_id`` may be freed (report it finished sending)."""

    request_id: str


@dataclass(frozen=True)
class Received:
    """D: request ``request_id`` leaves the wait (report it finished receiving; ``ok`` = KV valid)."""

    request_id: str
    ok: bool


@dataclass(frozen=True)
class Connect:
    """D: open the side channel to ``peer`` and report ``peer_ready`` or ``peer_lost``."""

    peer: PeerAddress


Action = StartWrite | AbandonWrite | Send | Release | Received | Connect


# --------------------------------------------------------------------------------------------
# Prefill side
# --------------------------------------------------------------------------------------------


class PState(enum.Enum):
    AWAIT_REGISTRATION = "await_registration"  # prefill done, blocks held, D not heard of
    AWAIT_PREFILL = "await_prefill"  # registration held, prefill still running
    WRITING = "writing"  # WRITE posted, not yet DONE
    DONE = "done"  # tombstone: transfer over (written, failed or expired)
    FAILED = "failed"  # tombstone: prefill ended without KV before D registered
    CANCELLED = "cancelled"  # tombstone: D cancelled and was acked; never write this key


P_TERMINAL = frozenset({PState.DONE, PState.FAILED, PState.CANCELLED})


@dataclass
class PEntry:
    state: PState
    deadline: float
    request_id: str | None = None  # P's vLLM request whose blocks we hold (while held)
    blocks: tuple[int, ...] = ()
    registration: Registration | None = None
    cancel_pending: bool = False  # a Cancel arrived while WRITING
    cancelled_d_request: str | None = None


class PrefillRendezvous:
    """Meets "prefill finished" and "registration received" in either order, per pairing key."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.entries: dict[str, PEntry] = {}
        self.counters: Counter[str] = Counter()

    # ---- events ------------------------------------------------------------------------

    def on_prefill_finished(self, key: str, request_id: str, blocks: tuple[int, ...], now: float) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = PEntry(PState.AWAIT_REGISTRATION, now + self.timeouts.lease_s, request_id, blocks)
            return []
        if entry.state is PState.AWAIT_PREFILL:
            assert entry.registration is not None
            entry.request_id, entry.blocks = request_id, blocks
            return self._write_or_refuse(key, entry, now)
        # Cancelled, failed, done or already holding blocks: never pair a second prefill.
        self.counters["late_prefill" if entry.state in P_TERMINAL else "duplicate"] += 1
        return [Release(request_id)]

    def on_prefill_failed(self, key: str, reason: str, now: float) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = PEntry(PState.FAILED, now + self.timeouts.lease_s)
            return []
        if entry.state is PState.AWAIT_PREFILL:
            assert entry.registration is not None
            self._finish(entry, PState.DONE, now)
            self.counters["prefill_failed"] += 1
            return [self._fail(entry.registration, f"prefill failed: {reason}")]
        self.counters["duplicate"] += 1
        return []

    def on_registration(self, reg: Registration, now: float) -> list[Action]:
        entry = self.entries.get(reg.key)
        if entry is None:
            if now >= reg.write_deadline:
                self.counters["expired"] += 1
                self.entries[reg.key] = PEntry(PState.DONE, now + self.timeouts.lease_s, registration=reg)
                return [self._fail(reg, "registration arrived after its write deadline")]
            self.entries[reg.key] = PEntry(PState.AWAIT_PREFILL, reg.write_deadline, registration=reg)
            return []
        if entry.state is PState.AWAIT_REGISTRATION:
            entry.registration = reg
            return self._write_or_refuse(reg.key, entry, now)
        if entry.state is PState.FAILED:
            entry.registration = reg
            self._finish(entry, PState.DONE, now)
            self.counters["prefill_failed"] += 1
            return [self._fail(reg, "prefill failed")]
        return self._repeated_registration(entry, reg)

    def on_cancel(self, cancel: Cancel, now: float) -> list[Action]:
        entry = self.entries.get(cancel.key)
        ack = Send(cancel.d_engine_id, CancelAck(cancel.key, cancel.d_request_id))
        if entry is None:
            self.entries[cancel.key] = PEntry(
                PState.CANCELLED, now + self.timeouts.lease_s, cancelled_d_request=cancel.d_request_id
            )
            self.counters["cancelled"] += 1
            return [ack]
        reg = entry.registration
        if reg is not None and reg.d_request_id != cancel.d_request_id:
            # Not the registration we would write to: nothing for it can land.
            self.counters["stale"] += 1
            return [ack]
        if entry.state is PState.WRITING:
            entry.cancel_pending = True  # ack once the WRITE is over
            return []
        if entry.state in P_TERMINAL:
            self.counters["duplicate"] += entry.state is PState.CANCELLED
            return [ack]
        # AWAIT_REGISTRATION or AWAIT_PREFILL: drop it, refuse any later pairing of this key.
        actions: list[Action] = [Release(entry.request_id)] if entry.request_id else []
        self._finish(entry, PState.CANCELLED, now)
        entry.cancelled_d_request = cancel.d_request_id
        self.counters["cancelled"] += 1
        return [*actions, ack]

    def on_write_result(self, key: str, ok: bool, now: float) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None or entry.state is not PState.WRITING:
            self.counters["stale"] += 1
            return []
        reg = entry.registration
        assert reg is not None and entry.request_id is not None
        actions: list[Action] = [Release(entry.request_id)]
        if ok:
            self.counters["written"] += 1
            if entry.cancel_pending:
                actions.append(Send(reg.d_engine_id, CancelAck(key, reg.d_request_id)))
        else:
            self.counters["write_failed"] += 1
            actions.append(self._fail(reg, "WRITE failed"))  # also releases a cancelling D
        self._finish(entry, PState.DONE, now)
        return actions

    def on_peer_lost(self, engine_id: str, now: float) -> list[Action]:
        """D's process is gone: drop registrations waiting for a prefill (nobody to write to)."""
        for entry in self.entries.values():
            reg = entry.registration
            if entry.state is PState.AWAIT_PREFILL and reg is not None and reg.d_engine_id == engine_id:
                self._finish(entry, PState.DONE, now)
                self.counters["peer_lost"] += 1
        return []

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key, entry in list(self.entries.items()):
            if entry.deadline > now:
                continue
            if entry.state in P_TERMINAL:
                del self.entries[key]
                continue
            self.counters["expired"] += 1
            if entry.state is PState.WRITING:
                assert entry.registration is not None
                actions.append(AbandonWrite(key))
            if entry.request_id is not None:
                actions.append(Release(entry.request_id))
            if entry.registration is not None:
                actions.append(self._fail(entry.registration, f"expired in {entry.state.value}"))
            self._finish(entry, PState.DONE, now)
        return actions

    # ---- helpers -----------------------------------------------------------------------

    def _write_or_refuse(self, key: str, entry: PEntry, now: float) -> list[Action]:
        reg, request_id = entry.registration, entry.request_id
        assert reg is not None and request_id is not None
        if now >= reg.write_deadline:
            self.counters["expired"] += 1
            self._finish(entry, PState.DONE, now)
            return [Release(request_id), self._fail(reg, "write deadline passed")]
        entry.state = PState.WRITING
        entry.deadline = now + self.timeouts.write_timeout_s
        return [StartWrite(key, request_id, entry.blocks, reg)]

    def _repeated_registration(self, entry: PEntry, reg: Registration) -> list[Action]:
        known = entry.registration
        same = (known is not None and known.d_request_id == reg.d_request_id) or (
            entry.cancelled_d_request == reg.d_request_id
        )
        if same:
            self.counters["duplicate"] += 1
            return []
        # Another decode request claims a key that is taken: tell it at once.
        self.counters["conflict"] += 1
        return [self._fail(reg, "pairing key already used by another decode request")]

    def _finish(self, entry: PEntry, state: PState, now: float) -> None:
        entry.state = state
        entry.deadline = now + self.timeouts.lease_s
        entry.request_id = None
        entry.blocks = ()
        entry.cancel_pending = False

    @staticmethod
    def _fail(reg: Registration, reason: str) -> Send:
        return Send(reg.d_engine_id, Failure(reg.key, reg.d_request_id, reason))


# --------------------------------------------------------------------------------------------
# Decode side
# --------------------------------------------------------------------------------------------


class DState(enum.Enum):
    PENDING_SEND = "pending_send"  # waiting for the side-channel handshake with P
    AWAITING_KV = "awaiting_kv"  # registration sent, waiting for Done / Failure
    CANCELLING = "cancelling"  # aborted after sending; blocks held until P acks


@dataclass
class DEntry:
    state: DState
    deadline: float
    key: str
    peer: PeerAddress
    block_ids: tuple[int, ...]


@dataclass
class DecodeRendezvous:
    """Tracks each decode request from registration until its blocks may be used or freed."""

    timeouts: Timeouts
    engine_id: str
    entries: dict[str, DEntry] = field(default_factory=dict)
    peers: dict[str, float] = field(default_factory=dict)  # P engine id -> min clock offset (P - D)
    counters: Counter[str] = field(default_factory=Counter)

    def on_register(
        self, request_id: str, key: str, peer: PeerAddress, block_ids: tuple[int, ...], now: float
    ) -> list[Action]:
        if request_id in self.entries:
            self.counters["duplicate"] += 1
            return []
        entry = DEntry(DState.PENDING_SEND, now + self.timeouts.connect_timeout_s, key, peer, block_ids)
        self.entries[request_id] = entry
        if peer.engine_id in self.peers:
            return self._send_registration(request_id, entry, now)
        return [Connect(peer)]

    def on_peer_ready(self, engine_id: str, clock_offset: float, now: float) -> list[Action]:
        """Handshake with P done; ``clock_offset`` is a lower bound of (P clock - D clock)."""
        self.peers[engine_id] = clock_offset
        actions: list[Action] = []
        for request_id, entry in self.entries.items():
            if entry.state is DState.PENDING_SEND and entry.peer.engine_id == engine_id:
                actions += self._send_registration(request_id, entry, now)
        return actions

    def on_peer_lost(self, engine_id: str, now: float) -> list[Action]:
        """P is unreachable or its process ended: nothing more can come from it, nor land."""
        self.peers.pop(engine_id, None)
        lost = [r for r, e in self.entries.items() if e.peer.engine_id == engine_id]
        self.counters["peer_lost"] += len(lost)
        return [self._leave(r, ok=False) for r in lost]

    def on_notice(self, notice: Notice, now: float) -> list[Action]:
        entry = self.entries.get(notice.d_request_id)
        if entry is None or entry.key != notice.key or entry.state is DState.PENDING_SEND:
            self.counters["stale"] += 1
            return []
        if isinstance(notice, Done):
            ok = entry.state is DState.AWAITING_KV
            self.counters["received" if ok else "released"] += 1
            return [self._leave(notice.d_request_id, ok=ok)]
        if isinstance(notice, Failure):
            self.counters["failed" if entry.state is DState.AWAITING_KV else "released"] += 1
            return [self._leave(notice.d_request_id, ok=False)]
        if isinstance(notice, CancelAck) and entry.state is DState.CANCELLING:
            self.counters["released"] += 1
            return [self._leave(notice.d_request_id, ok=False)]
        self.counters["stale"] += 1
        return []

    def on_abort(self, request_id: str, now: float) -> list[Action]:
        """vLLM finished the request while it waited for KV: free its blocks only when safe."""
        entry = self.entries.get(request_id)
        if entry is None:
            self.counters["stale"] += 1
            return []
        if entry.state is DState.PENDING_SEND:
            return [self._leave(request_id, ok=False)]  # P never learnt our block ids
        if entry.state is DState.AWAITING_KV:
            entry.state = DState.CANCELLING  # keeps the hold deadline set at send time
            return [Send(entry.peer.engine_id, Cancel(entry.key, request_id, self.engine_id))]
        self.counters["duplicate"] += 1
        return []

    def expire(self, now: float) -> list[Action]:
        expired = [r for r, e in self.entries.items() if e.deadline <= now]
        self.counters["expired"] += len(expired)
        return [self._leave(r, ok=False) for r in expired]

    # ---- helpers -----------------------------------------------------------------------

    def _send_registration(self, request_id: str, entry: DEntry, now: float) -> list[Action]:
        entry.state = DState.AWAITING_KV
        entry.deadline = now + self.timeouts.kv_timeout_s
        last_write_d = entry.deadline - self.timeouts.write_grace_s
        reg = Registration(
            key=entry.key,
            d_request_id=request_id,
            d_engine_id=self.engine_id,
            block_ids=entry.block_ids,
            write_deadline=last_write_d + self.peers[entry.peer.engine_id],
        )
        return [Send(entry.peer.engine_id, reg)]

    def _leave(self, request_id: str, ok: bool) -> Received:
        del self.entries[request_id]
        return Received(request_id, ok)
