"""Pure rendezvous state machines: one per transfer on the prefill side (here), one per request on decode
(`connector.decode_rendezvous`), and the actions and deadlines both share.

No vLLM, NIXL, torch or threading here. The transfer thread feeds events (each takes ``now``,
the caller's monotonic clock) and performs the returned actions; tests drive the machines
directly. Both machines hold every entry under a deadline kept in a heap, so ``expire(now)``
eventually removes everything (guarantee G5) and costs O(log n) per due entry, not a scan.

Prefill side, per pairing key (``PrefillRendezvous``)::

    (none) --finished--> AWAIT_REGISTRATION --registration--> WRITING --write done--> DONE
    (none) --registration--> AWAIT_PREFILL --finished--> WRITING
    AWAIT_* --registration/finished that do not fit (more blocks than held, other prompt)--> DONE (refused)
    (none) --failed--> FAILED (tombstone: a late registration is answered with a Failure)
    (none) / AWAIT_* --cancel--> CANCELLED (tombstone: acked; a late registration/finish is refused)
    WRITING --cancel--> WRITING(cancel pending): the ack waits until the WRITE is over
    WRITING --write failed (ERR) or deadline (abandoned)--> the handle must be released first:
        released at once            --> DONE (blocks released, D told Failure: it may free)
        release refused (stuck)     --> RELEASING (blocks held, D told Failure(quarantine): it
                                        reports the request failed now and frees at its hold deadline)
    RELEASING --released--> DONE (blocks released; D told a plain Failure so it may free early)
    RELEASING --hold limit--> DONE (blocks released: D's own hold deadline has passed by then)
    AWAIT_REGISTRATION / AWAIT_PREFILL --deadline--> DONE (expired; blocks released / D told)
    DONE / FAILED / CANCELLED --deadline--> removed

Decode side, per D request id (``DecodeRendezvous``)::

    (none) --register--> PENDING_SEND (no connection to P yet) --peer ready--> AWAITING_KV
    (none) --register, peer ready--> AWAITING_KV
    AWAITING_KV --done--> received;  --failure / deadline--> received with error
    AWAITING_KV --failure(quarantine) / link lost--> QUARANTINED: reported failed at once,
        blocks held until the hold deadline (or a plain Failure: P released the WRITE)
    AWAITING_KV --abort--> CANCELLING --ack / done / failure / deadline--> released
    PENDING_SEND --abort / link lost--> released at once (P never saw the blocks)
    (none) --aborted before allocation--> PENDING_CANCEL --peer ready--> Cancel sent, removed
        (or Cancel sent at once when P is connected; vLLM holds nothing for it)

The safety argument for guarantee G2 ("never a write into freed blocks"): D reports a request
finished (which lets vLLM free its blocks) only after P's ``Done``, ``CancelAck`` or plain
``Failure``, or after the hold deadline. P sends those only when no WRITE for the key is in flight:
a failed or abandoned WRITE first has its handle released (the backend's confirmation that no
part of it can still land); a release the backend refuses keeps P's blocks and handle and makes
D hold its blocks until the hold deadline (quarantine). A closed or silent side channel is not
proof that P's process is gone, so it fails D's requests at once but also quarantines their
blocks. P never posts a WRITE after the registration's ``write_deadline``, which D places
``write_grace_s`` before its hold deadline, and abandons a WRITE that runs longer than
``write_timeout_s`` (< ``write_grace_s``).
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from connector.metadata import (
    Cancel,
    CancelAck,
    Failure,
    Notice,
    PeerAddress,
    Registration,
)


class Tally(enum.StrEnum):
    """Every event counter of the connector (one name per event; ``connector.stats`` maps each to a
    Prometheus series, and a unit test checks that none is left out)."""

    AGENTS_REMOVED = "agents_removed"
    BAD_NOTICES = "bad_notices"
    CANCELLED = "cancelled"
    CONFLICT = "conflict"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    FAILED = "failed"
    FAILED_NOTICES = "failed_notices"
    LATE_PREFILL = "late_prefill"
    MISMATCH = "mismatch"
    PEER_LOST = "peer_lost"
    PREFILL_FAILED = "prefill_failed"
    QUARANTINE_EXPIRED = "quarantine_expired"
    QUARANTINED = "quarantined"
    RECEIVED = "received"
    RELEASE_REFUSED = "release_refused"
    RELEASED = "released"
    STALE = "stale"
    THREAD_ERRORS = "thread_errors"
    UNKNOWN_NOTICES = "unknown_notices"
    WRITE_FAILED = "write_failed"
    WRITE_RELEASED = "write_released"
    WRITTEN = "written"


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
    """P: release the WRITE of ``key`` still in flight (it ran past ``write_timeout_s``), then
    report ``on_write_released`` or ``on_write_stuck``."""

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
class Failed:
    """D: report request ``request_id`` failed now; its blocks stay held (quarantine)."""

    request_id: str


@dataclass(frozen=True)
class Freed:
    """D: the quarantine of ``request_id`` is over (report it finished receiving; failure already told)."""

    request_id: str


@dataclass(frozen=True)
class Connect:
    """D: open the side channel to ``peer`` and report ``peer_ready`` or ``peer_lost``."""

    peer: PeerAddress


Action = StartWrite | AbandonWrite | Send | Release | Received | Failed | Freed | Connect


class Deadlines:
    """A min-heap of ``(deadline, seq, key)`` with lazy deletion: an item counts only while the
    entry it names still has that deadline."""

    def __init__(self, current: Callable[[str], float | None]) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0
        self._current = current

    def push(self, key: str, deadline: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))

    def due(self, now: float) -> list[str]:
        keys: dict[str, None] = {}
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self._current(key) == deadline:
                keys[key] = None
        return list(keys)

    def next(self) -> float | None:
        while self._heap and self._current(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None


# --------------------------------------------------------------------------------------------
# Prefill side
# --------------------------------------------------------------------------------------------


class PState(enum.Enum):
    AWAIT_REGISTRATION = "await_registration"  # prefill done, blocks held, D not heard of
    AWAIT_PREFILL = "await_prefill"  # registration held, prefill still running
    WRITING = "writing"  # WRITE posted, not yet DONE
    RELEASING = "releasing"  # WRITE failed or abandoned, handle not yet released: blocks held
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
    cancel_pending: bool = False  # a Cancel arrived while WRITING / RELEASING
    cancelled_d_request: str | None = None
    num_tokens: int = 0  # P's prompt length (0 = not known)
    quarantine_told: bool = False  # RELEASING: D already holds its blocks until its deadline


class PrefillRendezvous:
    """Meets "prefill finished" and "registration received" in either order, per pairing key."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.entries: dict[str, PEntry] = {}
        self.counters: Counter[str] = Counter()
        self.live = 0  # entries not in a terminal state (O(1) liveness check)
        self._deadlines = Deadlines(self._deadline_of)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    # ---- events ------------------------------------------------------------------------

    def on_prefill_finished(
        self, key: str, request_id: str, blocks: tuple[int, ...], now: float, num_tokens: int = 0
    ) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None:
            self._add(key, PEntry(PState.AWAIT_REGISTRATION, now + self.timeouts.lease_s, request_id, blocks))
            self.entries[key].num_tokens = num_tokens
            return []
        if entry.state is PState.AWAIT_PREFILL:
            assert entry.registration is not None
            entry.request_id, entry.blocks, entry.num_tokens = request_id, blocks, num_tokens
            return self._write_or_refuse(key, entry, now)
        # Cancelled, failed, done or already holding blocks: never pair a second prefill.
        self.counters[Tally.LATE_PREFILL if entry.state in P_TERMINAL else Tally.DUPLICATE] += 1
        return [Release(request_id)]

    def on_prefill_failed(self, key: str, reason: str, now: float) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None:
            self._add(key, PEntry(PState.FAILED, now + self.timeouts.lease_s))
            return []
        if entry.state is PState.AWAIT_PREFILL:
            assert entry.registration is not None
            self._finish(key, entry, PState.DONE, now)
            self.counters[Tally.PREFILL_FAILED] += 1
            return [self._fail(entry.registration, f"prefill failed: {reason}")]
        self.counters[Tally.DUPLICATE] += 1
        return []

    def on_registration(self, reg: Registration, now: float) -> list[Action]:
        entry = self.entries.get(reg.key)
        if entry is None:
            if now >= reg.write_deadline:
                self.counters[Tally.EXPIRED] += 1
                self._add(reg.key, PEntry(PState.DONE, now + self.timeouts.lease_s, registration=reg))
                return [self._fail(reg, "registration arrived after its write deadline")]
            self._add(reg.key, PEntry(PState.AWAIT_PREFILL, reg.write_deadline, registration=reg))
            return []
        if entry.state is PState.AWAIT_REGISTRATION:
            entry.registration = reg
            return self._write_or_refuse(reg.key, entry, now)
        if entry.state is PState.FAILED:
            entry.registration = reg
            self._finish(reg.key, entry, PState.DONE, now)
            self.counters[Tally.PREFILL_FAILED] += 1
            return [self._fail(reg, "prefill failed")]
        return self._repeated_registration(entry, reg)

    def on_cancel(self, cancel: Cancel, now: float) -> list[Action]:
        entry = self.entries.get(cancel.key)
        ack = Send(cancel.d_engine_id, CancelAck(cancel.key, cancel.d_request_id))
        if entry is None:
            self._add(
                cancel.key,
                PEntry(PState.CANCELLED, now + self.timeouts.lease_s, cancelled_d_request=cancel.d_request_id),
            )
            self.counters[Tally.CANCELLED] += 1
            return [ack]
        reg = entry.registration
        if reg is not None and reg.d_request_id != cancel.d_request_id:
            # Not the registration we would write to: nothing for it can land.
            self.counters[Tally.STALE] += 1
            return [ack]
        if entry.state in (PState.WRITING, PState.RELEASING):
            entry.cancel_pending = True  # answered once the WRITE is over (ack or Failure)
            return []
        if entry.state in P_TERMINAL:
            self.counters[Tally.DUPLICATE] += entry.state is PState.CANCELLED
            return [ack]
        # AWAIT_REGISTRATION or AWAIT_PREFILL: drop it, refuse any later pairing of this key.
        actions: list[Action] = [Release(entry.request_id)] if entry.request_id else []
        self._finish(cancel.key, entry, PState.CANCELLED, now)
        entry.cancelled_d_request = cancel.d_request_id
        self.counters[Tally.CANCELLED] += 1
        return [*actions, ack]

    def on_write_done(self, key: str, now: float) -> list[Action]:
        """The WRITE completed (its ``Done`` travels with the data) and its handle is released."""
        entry = self.entries.get(key)
        if entry is None or entry.state is not PState.WRITING:
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None and entry.request_id is not None
        actions: list[Action] = [Release(entry.request_id)]
        self.counters[Tally.WRITTEN] += 1
        if entry.cancel_pending:
            actions.append(Send(reg.d_engine_id, CancelAck(key, reg.d_request_id)))
        self._finish(key, entry, PState.DONE, now)
        return actions

    def on_write_released(self, key: str, now: float) -> list[Action]:
        """A WRITE that failed or was abandoned is released: nothing of it can land any more."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in (PState.WRITING, PState.RELEASING):
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None and entry.request_id is not None
        self.counters[Tally.WRITE_FAILED if entry.state is PState.WRITING else Tally.WRITE_RELEASED] += 1
        actions: list[Action] = [Release(entry.request_id), self._fail(reg, "WRITE failed")]
        self._finish(key, entry, PState.DONE, now)
        return actions

    def on_write_stuck(self, key: str, now: float) -> list[Action]:
        """A WRITE failed or was abandoned and the backend refused to release its handle: keep the
        blocks, tell D to fail the request now and hold its blocks until its hold deadline."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in (PState.WRITING, PState.RELEASING):
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None
        if entry.state is PState.WRITING:
            self.counters[Tally.WRITE_FAILED] += 1
        self._enter_releasing(key, entry, reg)
        if entry.quarantine_told:
            return []
        entry.quarantine_told = True
        self.counters[Tally.QUARANTINED] += 1
        return [self._fail(reg, "WRITE failed and could not be released", quarantine=True)]

    def on_peer_lost(self, engine_id: str, now: float) -> list[Action]:
        """D's link is gone: drop registrations waiting for a prefill (nothing will be written)."""
        for key, entry in self.entries.items():
            reg = entry.registration
            if entry.state is PState.AWAIT_PREFILL and reg is not None and reg.d_engine_id == engine_id:
                self._finish(key, entry, PState.DONE, now)
                self.counters[Tally.PEER_LOST] += 1
        return []

    def expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for key in self._deadlines.due(now):
            entry = self.entries[key]
            if entry.state in P_TERMINAL:
                del self.entries[key]
                continue
            actions += self._expire_live(key, entry, now)
        return actions

    # ---- helpers -----------------------------------------------------------------------

    def _expire_live(self, key: str, entry: PEntry, now: float) -> list[Action]:
        reg = entry.registration
        if entry.state is PState.WRITING:
            assert reg is not None
            self.counters[Tally.EXPIRED] += 1
            self._enter_releasing(key, entry, reg)
            return [AbandonWrite(key)]  # answered with on_write_released / on_write_stuck
        actions: list[Action] = []
        if entry.state is PState.RELEASING:
            assert reg is not None
            self.counters[Tally.QUARANTINE_EXPIRED] += 1
            if not entry.quarantine_told:
                actions.append(self._fail(reg, "WRITE could not be released", quarantine=True))
        else:
            self.counters[Tally.EXPIRED] += 1
            if reg is not None:
                actions.append(self._fail(reg, f"expired in {entry.state.value}"))
        if entry.request_id is not None:
            actions.insert(0, Release(entry.request_id))
        self._finish(key, entry, PState.DONE, now)
        return actions

    def _enter_releasing(self, key: str, entry: PEntry, reg: Registration) -> None:
        if entry.state is PState.RELEASING:
            return
        entry.state = PState.RELEASING
        # D's hold deadline in P's clock is at least this (its clock offset is a lower bound).
        self._set_deadline(key, entry, reg.write_deadline + self.timeouts.write_grace_s)

    def _write_or_refuse(self, key: str, entry: PEntry, now: float) -> list[Action]:
        reg, request_id = entry.registration, entry.request_id
        assert reg is not None and request_id is not None
        refusal = self._mismatch(reg, entry)
        if refusal is None and now >= reg.write_deadline:
            self.counters[Tally.EXPIRED] += 1
            refusal = "write deadline passed"
        elif refusal is not None:
            self.counters[Tally.MISMATCH] += 1
        if refusal is not None:
            self._finish(key, entry, PState.DONE, now)
            return [Release(request_id), self._fail(reg, refusal)]
        entry.state = PState.WRITING
        self._set_deadline(key, entry, now + self.timeouts.write_timeout_s)
        return [StartWrite(key, request_id, entry.blocks, reg)]

    @staticmethod
    def _mismatch(reg: Registration, entry: PEntry) -> str | None:
        """Why this registration cannot be written from these blocks (None: it can)."""
        if len(reg.block_ids) > len(entry.blocks):
            return (
                f"decode registered {len(reg.block_ids)} blocks for {reg.num_tokens} tokens, "
                f"prefill holds {len(entry.blocks)} for {entry.num_tokens}"
            )
        if reg.num_tokens and entry.num_tokens and reg.num_tokens != entry.num_tokens:
            return f"decode's prompt has {reg.num_tokens} tokens, prefill's {entry.num_tokens}"
        return None

    def _repeated_registration(self, entry: PEntry, reg: Registration) -> list[Action]:
        known = entry.registration
        same = (known is not None and known.d_request_id == reg.d_request_id) or (
            entry.cancelled_d_request == reg.d_request_id
        )
        if same:
            self.counters[Tally.DUPLICATE] += 1
            return []
        # Another decode request claims a key that is taken: tell it at once.
        self.counters[Tally.CONFLICT] += 1
        return [self._fail(reg, "pairing key already used by another decode request")]

    def _add(self, key: str, entry: PEntry) -> None:
        self.entries[key] = entry
        self.live += entry.state not in P_TERMINAL
        self._deadlines.push(key, entry.deadline)

    def _finish(self, key: str, entry: PEntry, state: PState, now: float) -> None:
        self.live -= entry.state not in P_TERMINAL
        entry.state = state
        self._set_deadline(key, entry, now + self.timeouts.lease_s)
        entry.request_id = None
        entry.blocks = ()
        entry.cancel_pending = False

    def _set_deadline(self, key: str, entry: PEntry, deadline: float) -> None:
        entry.deadline = deadline
        self._deadlines.push(key, deadline)

    def _deadline_of(self, key: str) -> float | None:
        entry = self.entries.get(key)
        return None if entry is None else entry.deadline

    @staticmethod
    def _fail(reg: Registration, reason: str, quarantine: bool = False) -> Send:
        return Send(reg.d_engine_id, Failure(reg.key, reg.d_request_id, reason, quarantine))


# --------------------------------------------------------------------------------------------
