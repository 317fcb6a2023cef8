"""The decode side's pure rendezvous state machine: one entry per D request, from registration until its blocks
may be used or freed. The transitions and the safety argument (G2) are drawn in `connector.rendezvous.prefill`."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from connector.rendezvous.actions import Action, Connect, Deadlines, Failed, Freed, Received, Send, Tally, Timeouts
from connector.wire.metadata import (
    Cancel,
    CancelAck,
    Done,
    Failure,
    Notice,
    PeerAddress,
    Registration,
)


class DState(enum.Enum):
    PENDING_SEND = "pending_send"  # waiting for the side-channel handshake with P
    AWAITING_KV = "awaiting_kv"  # registration sent, waiting for Done / Failure
    CANCELLING = "cancelling"  # aborted after sending; blocks held until P acks
    QUARANTINED = "quarantined"  # reported failed; blocks held until the hold deadline
    PENDING_CANCEL = "pending_cancel"  # aborted before allocation: Cancel waits for the handshake


@dataclass
class DEntry:
    state: DState
    deadline: float
    key: str
    peer: PeerAddress
    block_ids: tuple[int, ...]
    num_tokens: int = 0


@dataclass
class DecodeRendezvous:
    """Tracks each decode request from registration until its blocks may be used or freed."""

    timeouts: Timeouts
    engine_id: str
    d_rank: int = 0  # this D rank (its registrations and cancels name it)
    entries: dict[str, DEntry] = field(default_factory=dict)
    peers: dict[str, float] = field(default_factory=dict)  # P engine id -> min clock offset (P - D)
    counters: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._deadlines = Deadlines(self._deadline_of)

    @property
    def live(self) -> int:
        return len(self.entries)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def on_register(
        self,
        request_id: str,
        key: str,
        peer: PeerAddress,
        block_ids: tuple[int, ...],
        now: float,
        num_tokens: int = 0,
    ) -> list[Action]:
        if request_id in self.entries:
            self.counters[Tally.DUPLICATE] += 1
            return []
        entry = DEntry(DState.PENDING_SEND, 0.0, key, peer, block_ids, num_tokens)
        self._put(request_id, entry, now + self.timeouts.connect_timeout_s)
        if peer.key in self.peers:
            return self._send_registration(request_id, entry, now)
        return [Connect(peer)]

    def on_abort_unallocated(self, request_id: str, key: str, peer: PeerAddress, now: float) -> list[Action]:
        """vLLM finished a decode request before it allocated blocks: P may hold blocks for it."""
        if request_id in self.entries:
            self.counters[Tally.DUPLICATE] += 1
            return []
        self.counters[Tally.CANCELLED] += 1
        if peer.key in self.peers:
            return [Send(peer.key, Cancel(key, request_id, self.engine_id, self.d_rank))]
        entry = DEntry(DState.PENDING_CANCEL, 0.0, key, peer, ())
        self._put(request_id, entry, now + self.timeouts.connect_timeout_s)
        return [Connect(peer)]

    def on_peer_ready(self, engine_id: str, clock_offset: float, now: float) -> list[Action]:
        """Handshake with P done; ``clock_offset`` is a lower bound of (P clock - D clock)."""
        self.peers[engine_id] = clock_offset
        actions: list[Action] = []
        for request_id, entry in list(self.entries.items()):
            if entry.peer.key != engine_id:
                continue
            if entry.state is DState.PENDING_SEND:
                actions += self._send_registration(request_id, entry, now)
            elif entry.state is DState.PENDING_CANCEL:
                del self.entries[request_id]
                actions.append(Send(engine_id, Cancel(entry.key, request_id, self.engine_id, self.d_rank)))
        return actions

    def on_peer_lost(self, engine_id: str, now: float) -> list[Action]:
        """P's side channel closed or went silent. That is not proof that its process is gone:
        fail what waits for KV now, but keep blocks P knows of until their hold deadline."""
        self.peers.pop(engine_id, None)
        actions: list[Action] = []
        for request_id, entry in list(self.entries.items()):
            if entry.peer.key != engine_id:
                continue
            if entry.state is DState.PENDING_SEND:
                self.counters[Tally.PEER_LOST] += 1
                actions.append(self._leave(request_id, ok=False))  # P never saw the blocks
            elif entry.state is DState.PENDING_CANCEL:
                del self.entries[request_id]
            elif entry.state is DState.AWAITING_KV:
                self.counters[Tally.PEER_LOST] += 1
                entry.state = DState.QUARANTINED
                actions.append(Failed(request_id))
        return actions

    def on_notice(self, notice: Notice, now: float) -> list[Action]:
        entry = self.entries.get(notice.d_request_id)
        if entry is None or entry.key != notice.key or entry.state in (DState.PENDING_SEND, DState.PENDING_CANCEL):
            self.counters[Tally.STALE] += 1
            return []
        if isinstance(notice, Done):
            return self._on_done(notice.d_request_id, entry)
        if isinstance(notice, Failure):
            return self._on_failure(notice.d_request_id, entry, notice.quarantine)
        if isinstance(notice, CancelAck) and entry.state is DState.CANCELLING:
            self.counters[Tally.RELEASED] += 1
            return [self._leave(notice.d_request_id, ok=False)]
        self.counters[Tally.STALE] += 1
        return []

    def on_abort(self, request_id: str, now: float) -> list[Action]:
        """vLLM finished the request while it waited for KV: free its blocks only when safe."""
        entry = self.entries.get(request_id)
        if entry is None:
            self.counters[Tally.STALE] += 1
            return []
        if entry.state is DState.PENDING_SEND:
            return [self._leave(request_id, ok=False)]  # P never learnt our block ids
        if entry.state is DState.AWAITING_KV:
            entry.state = DState.CANCELLING  # keeps the hold deadline set at send time
            return [Send(entry.peer.key, Cancel(entry.key, request_id, self.engine_id, self.d_rank))]
        self.counters[Tally.DUPLICATE] += 1
        return []

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for request_id in self._deadlines.due(now):
            entry = self.entries[request_id]
            if entry.state is DState.PENDING_CANCEL:
                del self.entries[request_id]
                continue
            self.counters[Tally.EXPIRED] += 1
            if entry.state is DState.QUARANTINED:
                del self.entries[request_id]
                actions.append(Freed(request_id))
            else:
                actions.append(self._leave(request_id, ok=False))
        return actions

    # ---- helpers -----------------------------------------------------------------------

    def _on_done(self, request_id: str, entry: DEntry) -> list[Action]:
        if entry.state is DState.QUARANTINED:
            self.counters[Tally.STALE] += 1  # already failed; the hold deadline frees it
            return []
        ok = entry.state is DState.AWAITING_KV
        self.counters[Tally.RECEIVED if ok else Tally.RELEASED] += 1
        return [self._leave(request_id, ok=ok)]

    def _on_failure(self, request_id: str, entry: DEntry, quarantine: bool) -> list[Action]:
        if entry.state is DState.QUARANTINED:
            if quarantine:
                return []
            del self.entries[request_id]  # P released the WRITE: nothing can land any more
            self.counters[Tally.RELEASED] += 1
            return [Freed(request_id)]
        if not quarantine:
            self.counters[Tally.FAILED if entry.state is DState.AWAITING_KV else Tally.RELEASED] += 1
            return [self._leave(request_id, ok=False)]
        self.counters[Tally.QUARANTINED] += 1
        if entry.state is DState.CANCELLING:
            return []  # vLLM finished it already; the hold deadline frees it
        entry.state = DState.QUARANTINED
        return [Failed(request_id)]

    def _send_registration(self, request_id: str, entry: DEntry, now: float) -> list[Action]:
        entry.state = DState.AWAITING_KV
        self._set_deadline(request_id, entry, now + self.timeouts.kv_timeout_s)
        last_write_d = entry.deadline - self.timeouts.write_grace_s
        reg = Registration(
            key=entry.key,
            d_request_id=request_id,
            d_engine_id=self.engine_id,
            block_ids=entry.block_ids,
            write_deadline=last_write_d + self.peers[entry.peer.key],
            num_tokens=entry.num_tokens,
            d_rank=self.d_rank,
        )
        return [Send(entry.peer.key, reg)]

    def _put(self, request_id: str, entry: DEntry, deadline: float) -> None:
        self.entries[request_id] = entry
        self._set_deadline(request_id, entry, deadline)

    def _set_deadline(self, request_id: str, entry: DEntry, deadline: float) -> None:
        entry.deadline = deadline
        self._deadlines.push(request_id, deadline)

    def _deadline_of(self, request_id: str) -> float | None:
        entry = self.entries.get(request_id)
        return None if entry is None else entry.deadline

    def _leave(self, request_id: str, ok: bool) -> Received:
        del self.entries[request_id]
        return Received(request_id, ok)
