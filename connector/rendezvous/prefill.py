"""Pure rendezvous state machines: one per transfer on the prefill side (here), one per request on decode
(`connector.rendezvous.decode`), and the actions and deadlines both share.

No vLLM, NIXL, torch or threading here. The transfer thread feeds events (each takes ``now``,
the caller's monotonic clock) and performs the returned actions; tests drive the machines
directly. Both machines hold every entry under a deadline kept in a heap, so ``expire(now)``
eventually removes everything (guarantee G5) and costs O(log n) per due entry, not a scan.

Prefill side, per pairing key (``PrefillRendezvous``)::

    (none) --finished--> AWAIT_REGISTRATION --registration--> WRITING --write done--> DONE
    (none) --registration--> AWAIT_PREFILL --finished--> WRITING
    AWAIT_PREFILL --progress (new full blocks; progressive push, G14)--> PUSHING: a partial WRITE, no Done
    PUSHING --progress--> PUSHING (the blocks join the next WRITE: one WRITE in flight per key)
    PUSHING --write done--> AWAIT_PREFILL (or PUSHING again with the blocks that became ready meanwhile)
    PUSHING --finished / failed (blocks now held)--> FLUSHING --write done--> WRITING (the final WRITE of
        the blocks not yet written, with Done) or DONE (prefill failed: D told Failure, blocks released)
    AWAIT_PREFILL / PUSHING --restarted (P preempted)--> no more partial WRITEs; the final WRITE writes all
    AWAIT_* --registration/finished that do not fit (more blocks than held, other prompt)--> DONE (refused)
    (none) --failed--> FAILED (tombstone: a late registration is answered with a Failure)
    (none) / AWAIT_* --cancel--> CANCELLED (tombstone: acked; a late registration/finish is refused)
    WRITING / PUSHING / FLUSHING --cancel--> cancel pending: the ack waits until the WRITE is over
    WRITING / PUSHING / FLUSHING --write failed (ERR) or deadline (abandoned)--> the handle must be released first:
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
blocks. With progressive push (G14) the same holds per key across its WRITEs: one is in flight at
a time, ``Done`` rides only on the final one, which is posted once every earlier one reported DONE,
and a Failure or CancelAck leaves only when none is in flight. P never posts a WRITE after the
registration's ``write_deadline``, which D places ``write_grace_s`` before its hold deadline, and
abandons a WRITE that runs longer than ``write_timeout_s`` (< ``write_grace_s``).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from connector.rendezvous.actions import (
    AbandonWrite,
    Action,
    Deadlines,
    Release,
    Send,
    StartWrite,
    Tally,
    Timeouts,
)
from connector.wire.metadata import Cancel, CancelAck, Done, Failure, Registration
from connector.wire.plan import PrefillProgress

__all__ = ["P_TERMINAL", "PEntry", "PState", "PrefillRendezvous", "progress_span"]

# --------------------------------------------------------------------------------------------
# Prefill side
# --------------------------------------------------------------------------------------------


class PState(enum.Enum):
    AWAIT_REGISTRATION = "await_registration"  # prefill done, blocks held, D not heard of
    AWAIT_PREFILL = "await_prefill"  # registration held, prefill still running, no WRITE in flight
    PUSHING = "pushing"  # progressive: a partial WRITE in flight, prefill still running
    FLUSHING = "flushing"  # progressive: a partial WRITE in flight, prefill over (its blocks held)
    WRITING = "writing"  # the final WRITE posted, not yet DONE
    RELEASING = "releasing"  # WRITE failed or abandoned, handle not yet released: blocks held
    DONE = "done"  # tombstone: transfer over (written, failed or expired)
    FAILED = "failed"  # tombstone: prefill ended without KV before D registered
    CANCELLED = "cancelled"  # tombstone: D cancelled and was acked; never write this key


P_TERMINAL = frozenset({PState.DONE, PState.FAILED, PState.CANCELLED})
_IN_FLIGHT = frozenset({PState.PUSHING, PState.FLUSHING, PState.WRITING})  # a WRITE of the key is posted


@dataclass
class PEntry:
    state: PState
    deadline: float
    request_id: str | None = None  # P's vLLM request whose blocks we hold (while held)
    blocks: tuple[int, ...] = ()
    registration: Registration | None = None
    cancel_pending: bool = False  # a Cancel arrived while a WRITE was in flight
    cancelled_d_request: str | None = None
    num_tokens: int = 0  # P's prompt length (0 = not known)
    quarantine_told: bool = False  # RELEASING: D already holds its blocks until its deadline
    # Progressive push (G14): P's first ``written`` prompt blocks are on D; the partial WRITE in flight
    # covers blocks [written, posting); ``ready`` are the prompt's full blocks computed so far.
    progressive: bool = True  # False after a refusal or a preemption: only the final WRITE, of everything
    prefilling: str | None = None  # the running prefill request the partial WRITEs read from
    ready: tuple[int, ...] = ()
    total_blocks: int = 0
    written: int = 0
    posting: int = 0
    prefill_failure: str | None = None  # FLUSHING: the prefill ended without KV
    writes: int = 0  # WRITEs posted for this key


def progress_span(
    ready: tuple[int, ...], total: int, remote: tuple[int, ...], start: int, stop: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """P's prompt blocks ``ready[start:stop]`` paired with D's registered blocks (tails aligned over the
    prompt's ``total`` blocks: D registers only the blocks it lacks, the last ``len(remote)``); the
    blocks D already holds are skipped. Both tuples empty: nothing of that span goes to D."""
    offset = total - len(remote)
    lo = max(start, offset)
    if stop <= lo:
        return (), ()
    return ready[lo:stop], remote[lo - offset : stop - offset]


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

    def on_prefill_progress(self, progress: PrefillProgress, now: float) -> list[Action]:
        """A step of a chunked prefill ended: ``progress.block_ids`` are the prompt's full blocks computed
        so far (a prefix of its ``total_blocks``). Registered and nothing in flight: WRITE the new ones
        now (no Done); a WRITE in flight: they join the next one. Not registered yet: nothing (a
        registration that comes later gets everything computed by then in one WRITE, then per step)."""
        entry = self.entries.get(progress.key)
        if entry is None or entry.state not in (PState.AWAIT_PREFILL, PState.PUSHING) or not entry.progressive:
            return []
        key = progress.key
        entry.prefilling, entry.ready = progress.request_id, progress.block_ids
        entry.total_blocks, entry.num_tokens = progress.total_blocks, progress.num_tokens
        return self._push_ready(key, entry, now) if entry.state is PState.AWAIT_PREFILL else []

    def on_prefill_restarted(self, key: str, now: float) -> list[Action]:
        """P's request was preempted: its recomputed KV is not bitwise the same, so no more partial
        WRITEs; the final WRITE writes every block again, after any WRITE in flight is over."""
        entry = self.entries.get(key)
        if entry is not None and entry.state in (PState.AWAIT_PREFILL, PState.PUSHING):
            entry.progressive = False
            entry.written = entry.posting = 0
            entry.ready = ()
        return []

    def on_prefill_finished(
        self, key: str, request_id: str, blocks: tuple[int, ...], now: float, num_tokens: int = 0
    ) -> list[Action]:
        entry = self.entries.get(key)
        if entry is None:
            self._add(key, PEntry(PState.AWAIT_REGISTRATION, now + self.timeouts.lease_s, request_id, blocks))
            self.entries[key].num_tokens = num_tokens
            return []
        if entry.state in (PState.AWAIT_PREFILL, PState.PUSHING):
            assert entry.registration is not None
            entry.request_id, entry.blocks, entry.num_tokens = request_id, blocks, num_tokens
            if entry.state is PState.PUSHING:
                entry.state = PState.FLUSHING  # the final WRITE waits for the partial one in flight
                return []
            return self._write_or_refuse(key, entry, now)
        if entry.state is PState.RELEASING and entry.request_id is None:
            entry.request_id, entry.blocks = request_id, blocks  # a stuck partial WRITE reads them
            return []
        # Cancelled, failed, done or already holding blocks: never pair a second prefill.
        self.counters[Tally.LATE_PREFILL if entry.state in P_TERMINAL else Tally.DUPLICATE] += 1
        return [Release(request_id)]

    def on_prefill_failed(self, key: str, reason: str, now: float, held: str | None = None) -> list[Action]:
        """The prefill ended without KV. ``held``: its request, whose blocks vLLM keeps for us (a
        progressive leg: a partial WRITE may read them); released once no WRITE of the key is in flight."""
        release: list[Action] = [Release(held)] if held is not None else []
        entry = self.entries.get(key)
        if entry is None:
            self._add(key, PEntry(PState.FAILED, now + self.timeouts.lease_s))
            return release
        if entry.state is PState.AWAIT_PREFILL:
            assert entry.registration is not None
            self._finish(key, entry, PState.DONE, now)
            self.counters[Tally.PREFILL_FAILED] += 1
            return [*release, self._fail(entry.registration, f"prefill failed: {reason}")]
        if entry.state is PState.PUSHING or (entry.state is PState.RELEASING and entry.request_id is None):
            entry.request_id = held
            entry.prefill_failure = reason
            entry.state = PState.FLUSHING if entry.state is PState.PUSHING else entry.state
            return []
        # A second end for the key: only the blocks of another request than the one held here are freed.
        self.counters[Tally.DUPLICATE] += 1
        return release if held != entry.request_id else []

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
        ack = Send(cancel.sender, CancelAck(cancel.key, cancel.d_request_id))
        if entry is None:
            # A registration D sent before this Cancel may still arrive (notices can be reordered): its write
            # deadline is under kv_timeout_s after it was sent, so a tombstone that long refuses it.
            hold = max(self.timeouts.lease_s, self.timeouts.kv_timeout_s)
            self._add(cancel.key, PEntry(PState.CANCELLED, now + hold, cancelled_d_request=cancel.d_request_id))
            self.counters[Tally.CANCELLED] += 1
            return [ack]
        reg = entry.registration
        if reg is not None and reg.d_request_id != cancel.d_request_id:
            # Not the registration we would write to: nothing for it can land.
            self.counters[Tally.STALE] += 1
            return [ack]
        if entry.state in _IN_FLIGHT or entry.state is PState.RELEASING:
            entry.cancel_pending = True  # answered once the WRITE is over (ack or Failure)
            return []
        if entry.state in P_TERMINAL:
            self.counters[Tally.DUPLICATE] += entry.state is PState.CANCELLED
            return [ack]
        # AWAIT_REGISTRATION or AWAIT_PREFILL: nothing in flight; drop it, refuse any later pairing.
        return [*self._cancel_now(cancel.key, entry, cancel.d_request_id, now), ack]

    def on_write_done(self, key: str, now: float) -> list[Action]:
        """The WRITE completed (a final one's ``Done`` travels with the data) and its handle is released."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in _IN_FLIGHT:
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None
        if entry.state is not PState.WRITING:
            return self._partial_done(key, entry, reg, now)
        assert entry.request_id is not None
        actions: list[Action] = [Release(entry.request_id)]
        self.counters[Tally.WRITTEN] += 1
        if entry.cancel_pending:
            actions.append(Send(reg.sender, CancelAck(key, reg.d_request_id)))
        self._finish(key, entry, PState.DONE, now)
        return actions

    def on_write_released(self, key: str, now: float) -> list[Action]:
        """A WRITE that failed or was abandoned is released: nothing of it can land any more."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in (*_IN_FLIGHT, PState.RELEASING):
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None
        self.counters[Tally.WRITE_FAILED if entry.state is not PState.RELEASING else Tally.WRITE_RELEASED] += 1
        actions: list[Action] = [Release(entry.request_id)] if entry.request_id is not None else []
        actions.append(self._fail(reg, "WRITE failed"))
        self._finish(key, entry, PState.DONE, now)
        return actions

    def on_write_stuck(self, key: str, now: float) -> list[Action]:
        """A WRITE failed or was abandoned and the backend refused to release its handle: keep the
        blocks, tell D to fail the request now and hold its blocks until its hold deadline."""
        entry = self.entries.get(key)
        if entry is None or entry.state not in (*_IN_FLIGHT, PState.RELEASING):
            self.counters[Tally.STALE] += 1
            return []
        reg = entry.registration
        assert reg is not None
        if entry.state is not PState.RELEASING:
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
            if entry.state is PState.AWAIT_PREFILL and reg is not None and reg.sender == engine_id:
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

    def _partial_done(self, key: str, entry: PEntry, reg: Registration, now: float) -> list[Action]:
        """A partial WRITE (PUSHING / FLUSHING) completed: nothing of the key is in flight now."""
        entry.written = entry.posting
        if entry.cancel_pending:
            return [
                *self._cancel_now(key, entry, reg.d_request_id, now),
                Send(reg.sender, CancelAck(key, reg.d_request_id)),
            ]
        if entry.state is PState.PUSHING:
            entry.state = PState.AWAIT_PREFILL
            self._set_deadline(key, entry, reg.write_deadline)
            return self._push_ready(key, entry, now)
        if entry.prefill_failure is not None:  # FLUSHING after a failed prefill
            actions: list[Action] = [Release(entry.request_id)] if entry.request_id is not None else []
            self.counters[Tally.PREFILL_FAILED] += 1
            self._finish(key, entry, PState.DONE, now)
            return [*actions, self._fail(reg, f"prefill failed: {entry.prefill_failure}")]
        return self._write_or_refuse(key, entry, now)

    def _cancel_now(self, key: str, entry: PEntry, d_request_id: str, now: float) -> list[Action]:
        actions: list[Action] = [Release(entry.request_id)] if entry.request_id else []
        self._finish(key, entry, PState.CANCELLED, now)
        entry.cancelled_d_request = d_request_id
        self.counters[Tally.CANCELLED] += 1
        return actions

    def _push_ready(self, key: str, entry: PEntry, now: float) -> list[Action]:
        """AWAIT_PREFILL, progressive: post one partial WRITE of the full blocks not yet written."""
        reg = entry.registration
        assert reg is not None and entry.prefilling is not None
        stop = len(entry.ready)
        if not entry.progressive or stop <= entry.written:
            return []
        fits = len(reg.block_ids) <= entry.total_blocks and (
            not (reg.num_tokens and entry.num_tokens) or reg.num_tokens == entry.num_tokens
        )
        if not fits or now >= reg.write_deadline:
            entry.progressive = False  # the final step refuses it (or the deadline ends it), as without
            return []
        local, remote = progress_span(entry.ready, entry.total_blocks, reg.block_ids, entry.written, stop)
        if not local:  # all of it already on D (its own prefix hit)
            entry.written = stop
            return []
        entry.posting, entry.state = stop, PState.PUSHING
        entry.writes += 1
        self._set_deadline(key, entry, now + self.timeouts.write_timeout_s)
        return [StartWrite(key, entry.prefilling, local, reg, remote, final=False, ordinal=entry.writes)]

    def _expire_live(self, key: str, entry: PEntry, now: float) -> list[Action]:
        reg = entry.registration
        if entry.state in _IN_FLIGHT:
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
        """The final WRITE: every block not yet written (all of them without progressive push), with Done."""
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
        remote: tuple[int, ...] | None = None
        local = entry.blocks
        if entry.written:
            local, remote = progress_span(entry.blocks, len(entry.blocks), reg.block_ids, entry.written, len(local))
            if not local:  # every block already landed: Done alone (nothing is in flight)
                self.counters[Tally.WRITTEN] += 1
                self._finish(key, entry, PState.DONE, now)
                return [Release(request_id), Send(reg.sender, Done(key, reg.d_request_id))]
        entry.state = PState.WRITING
        entry.writes += 1
        self._set_deadline(key, entry, now + self.timeouts.write_timeout_s)
        return [StartWrite(key, request_id, local, reg, remote, final=True, ordinal=entry.writes)]

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
        entry.ready = ()

    def _set_deadline(self, key: str, entry: PEntry, deadline: float) -> None:
        entry.deadline = deadline
        self._deadlines.push(key, deadline)

    def _deadline_of(self, key: str) -> float | None:
        entry = self.entries.get(key)
        return None if entry is None else entry.deadline

    @staticmethod
    def _fail(reg: Registration, reason: str, quarantine: bool = False) -> Send:
        return Send(reg.sender, Failure(reg.key, reg.d_request_id, reason, quarantine))
