"""P side under TP: one prefill rank's transfers fanned out over the D ranks it writes (pure: no I/O, no clock).

``PrefillRendezvous`` is today's pairwise machine, one entry per pairing key. Under P_tp < D_tp one P rank
holds heads that several D ranks need: every such D rank registers on its own (same pairing key, its own
``d_rank``), and each is a **leg**. ``PrefillFanOut`` wraps one ``PrefillRendezvous`` whose entries are legs
(``leg_key(key, d_rank)``) and keeps per pairing key what P knows of the prefill (finished blocks, failure,
progress, restart), replaying it into every leg that exists and into each leg created later by its own
registration. The transfer thread calls it exactly as it called the plain machine (same event methods; WRITE
events carry the leg key of the ``StartWrite``).

Rules (the guarantees of connector/README.md, per rank):

* **A D rank is written only after its own registration** (a leg exists only from its registration): a D rank
  whose handshake or registration failed is never written (upstream writes every target from the first
  registration: research turn3-tp.md §1.5).
* **P's blocks are released once, when no leg can still write them** (``fanin.FanOut``): every target D rank's
  leg is over (its machine reached a terminal state: written, failed and released, cancelled, expired), or
  never started and cannot any more (the lease after the prefill finished ran out, the prefill failed, or a
  sibling D rank cancelled: D's scheduler cancels every rank of a failed request, so that rank registers for a
  request already over). A leg whose WRITE failed and could not be released keeps the blocks (quarantine).
* **One D engine per pairing key**: the first registration (or cancel) names the D engine and its TP (the
  ``targets`` the caller computes from that D rank's handshake); another engine's registration is refused as a
  conflict, as the plain machine refuses another decode request. A registration of a D rank that is no target,
  or whose leg is already over, is answered with a ``Failure`` at once.

Notices leave with the pairing key (the leg key is P-internal). Single-target transfers (P_tp >= D_tp) go
through the same path with one leg.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from connector.parallel.fanin import FanOut
from connector.rendezvous.actions import Action, Deadlines, Release, Send, StartWrite, Tally, Timeouts
from connector.rendezvous.prefill import P_TERMINAL, PrefillRendezvous
from connector.wire.metadata import Cancel, CancelAck, Failure, Registration
from connector.wire.plan import PrefillProgress


def leg_key(key: str, d_rank: int) -> str:
    """The inner machine's key of the leg to ``d_rank`` (the rank prefix keeps it injective for any key)."""
    return f"{d_rank}:{key}"


def split_leg_key(leg: str) -> tuple[str, int]:
    rank, _, key = leg.partition(":")
    return key, int(rank)


@dataclass
class _Transfer:
    """What this P rank knows of one pairing key."""

    deadline: float
    request_id: str | None = None  # P's vLLM request whose blocks are held for the legs
    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    finished: bool = False
    failure: str | None = None  # the prefill ended without KV
    restarted: bool = False
    progress: PrefillProgress | None = None
    lease_at: float | None = None  # unregistered targets are over from then (set when the prefill finished)
    expired: bool = False  # the lease ran out before any D rank registered
    engine: str | None = None  # the D engine the first registration or cancel named
    gate: FanOut | None = None  # the D ranks this rank writes for that engine, and which legs are over
    legs: set[int] = field(default_factory=set)  # D ranks with a leg in the inner machine
    released: bool = False  # the Release of ``request_id`` was emitted


class PrefillFanOut:
    """``PrefillRendezvous``'s interface over legs (see the module docstring)."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.legs = PrefillRendezvous(timeouts)  # one entry per leg, keyed by ``leg_key``
        self.transfers: dict[str, _Transfer] = {}
        self._holding: set[str] = set()  # keys whose blocks are held and not yet released
        self._deadlines = Deadlines(self._deadline_of)

    @property
    def counters(self) -> Counter[str]:
        return self.legs.counters

    @property
    def entries(self) -> dict[str, _Transfer]:
        """The pairing keys this rank knows of (for tests and liveness)."""
        return self.transfers

    @property
    def live(self) -> int:
        """Legs not in a terminal state, plus transfers whose blocks are held for D ranks yet to register."""
        return self.legs.live + len(self._holding)

    def live_keys(self) -> set[str]:
        """Pairing keys a leg may still write for: a leg not in a terminal state, or blocks held for D ranks."""
        legs = {split_leg_key(k)[0] for k, e in self.legs.entries.items() if e.state not in P_TERMINAL}
        return legs | self._holding

    def next_deadline(self) -> float | None:
        nexts = [d for d in (self.legs.next_deadline(), self._deadlines.next()) if d is not None]
        return min(nexts) if nexts else None

    # ---- what P's scheduler reports ---------------------------------------------------------

    def on_prefill_finished(
        self, key: str, request_id: str, blocks: tuple[int, ...], now: float, num_tokens: int = 0
    ) -> list[Action]:
        t = self._transfer(key, now)
        if t.finished or t.failure is not None or t.released:
            self.counters[Tally.DUPLICATE if t.request_id is not None else Tally.LATE_PREFILL] += 1
            return [Release(request_id)]  # never pair a second prefill with a key
        t.finished, t.request_id, t.blocks, t.num_tokens = True, request_id, blocks, num_tokens
        t.lease_at = now + self.timeouts.lease_s
        self._hold(key, t)
        self._set_deadline(key, t, t.lease_at)
        legs = self.legs
        out = self._each_leg(key, t, lambda leg: legs.on_prefill_finished(leg, request_id, blocks, now, num_tokens))
        return out + self._settle(key, t, now)

    def on_prefill_failed(self, key: str, reason: str, now: float, held: str | None = None) -> list[Action]:
        t = self._transfer(key, now)
        if t.finished or t.failure is not None:
            self.counters[Tally.DUPLICATE] += 1
            return [Release(held)] if held is not None and held != t.request_id else []
        t.failure = reason
        if held is not None:
            t.request_id = held
            self._hold(key, t)
        if t.gate is not None:
            t.gate.on_lease_expired()  # targets not registered yet get nothing: their legs are over
        out = self._each_leg(key, t, lambda leg: self.legs.on_prefill_failed(leg, reason, now, held))
        return out + self._settle(key, t, now)

    def on_prefill_progress(self, progress: PrefillProgress, now: float) -> list[Action]:
        t = self.transfers.get(progress.key)
        if t is None or t.finished or t.failure is not None or t.restarted:
            return []  # after a restart only the final WRITE: a partial one may name blocks freed since
        t.progress = progress
        return self._each_leg(
            progress.key, t, lambda leg: self.legs.on_prefill_progress(replace(progress, key=leg), now)
        )

    def on_prefill_restarted(self, key: str, now: float) -> list[Action]:
        t = self._transfer(key, now)  # kept even before any registration: a later one must not push partially
        t.restarted, t.progress = True, None
        return self._each_leg(key, t, lambda leg: self.legs.on_prefill_restarted(leg, now))

    # ---- what D ranks send ------------------------------------------------------------------

    def on_registration(self, reg: Registration, now: float, targets: tuple[int, ...] | None = None) -> list[Action]:
        """``targets``: the D ranks of ``reg``'s engine this rank writes (None: the registering rank alone)."""
        t = self._transfer(reg.key, now)
        refusal = self._claim(t, reg.d_engine_id, targets or (reg.d_rank,))
        if refusal is not None:
            self.counters[Tally.CONFLICT] += 1
            return [Send(reg.sender, Failure(reg.key, reg.d_request_id, refusal))]
        leg, d = leg_key(reg.key, reg.d_rank), reg.d_rank
        if d not in t.legs:
            gate = t.gate
            assert gate is not None
            if not gate.on_registration(d):
                return [Send(reg.sender, Failure(reg.key, reg.d_request_id, self._why_not(t, gate, d)))]
            t.legs.add(d)
            out = self._replay(leg, replace(reg, key=leg), t, now)
        else:
            out = self.legs.on_registration(replace(reg, key=leg), now)
        return self._rewrite(reg.key, out) + self._settle(reg.key, t, now)

    def on_cancel(self, cancel: Cancel, now: float, targets: tuple[int, ...] | None = None) -> list[Action]:
        """A D rank cancels its leg. D's scheduler cancels every rank of a request, so the targets that did not
        register yet never will usefully: their legs are over (P may release once the running legs end)."""
        t = self._transfer(cancel.key, now)
        if self._claim(t, cancel.d_engine_id, targets or (cancel.d_rank,)) is not None:
            self.counters[Tally.STALE] += 1  # another engine's cancel: nothing of it is here
            return [Send(cancel.sender, CancelAck(cancel.key, cancel.d_request_id))]
        gate = t.gate
        assert gate is not None
        gate.on_registration(cancel.d_rank)
        t.legs.add(cancel.d_rank)
        out = self.legs.on_cancel(replace(cancel, key=leg_key(cancel.key, cancel.d_rank)), now)
        gate.on_lease_expired()
        return self._rewrite(cancel.key, out) + self._settle(cancel.key, t, now)

    def on_peer_lost(self, engine_id: str, now: float) -> list[Action]:
        out = self._rewrite_all(self.legs.on_peer_lost(engine_id, now))
        return out + self._settle_holding(now)

    # ---- WRITE outcomes (leg keys) ------------------------------------------------------------

    def on_write_done(self, leg: str, now: float) -> list[Action]:
        return self._leg_event(leg, self.legs.on_write_done(leg, now), now)

    def on_write_released(self, leg: str, now: float) -> list[Action]:
        return self._leg_event(leg, self.legs.on_write_released(leg, now), now)

    def on_write_stuck(self, leg: str, now: float) -> list[Action]:
        return self._leg_event(leg, self.legs.on_write_stuck(leg, now), now)

    def expire(self, now: float) -> list[Action]:
        out = self._rewrite_all(self.legs.expire(now))
        for key in self._deadlines.due(now):
            out += self._expire_transfer(key, self.transfers[key], now)
        return out + self._settle_holding(now)

    # ---- helpers -------------------------------------------------------------------------------

    def _transfer(self, key: str, now: float) -> _Transfer:
        t = self.transfers.get(key)
        if t is None:
            t = self.transfers[key] = _Transfer(now + self.timeouts.lease_s)
            self._deadlines.push(key, t.deadline)
        return t

    def _claim(self, t: _Transfer, engine: str, targets: tuple[int, ...]) -> str | None:
        """Bind the transfer to the first D engine that names it; None: ``engine`` is that engine."""
        if t.engine is None:
            t.engine, t.gate = engine, FanOut(tuple(sorted(targets)))
            if t.failure is not None or t.expired:
                t.gate.on_lease_expired()  # the prefill is over for every target not registered yet
        if t.engine != engine:
            return "pairing key already used by another decode engine"
        return None

    def _why_not(self, t: _Transfer, gate: FanOut, d: int) -> str:
        if d not in gate.targets:
            self.counters[Tally.MISMATCH] += 1
            return f"decode rank {d} is not written by this prefill rank (it writes ranks {list(gate.targets)})"
        if t.failure is not None:
            self.counters[Tally.PREFILL_FAILED] += 1
            return f"prefill failed: {t.failure}"
        self.counters[Tally.EXPIRED] += 1
        return "the transfer ended before this decode rank registered"

    def _replay(self, leg: str, reg: Registration, t: _Transfer, now: float) -> list[Action]:
        """A new leg: its registration, then what the prefill did so far, in order."""
        out = self.legs.on_registration(reg, now)
        if t.restarted:
            out += self.legs.on_prefill_restarted(leg, now)
        if t.progress is not None and not t.finished:
            out += self.legs.on_prefill_progress(replace(t.progress, key=leg), now)
        if t.finished and t.request_id is not None:
            out += self.legs.on_prefill_finished(leg, t.request_id, t.blocks, now, t.num_tokens)
        elif t.failure is not None:
            out += self.legs.on_prefill_failed(leg, t.failure, now, t.request_id)
        return out

    def _each_leg(self, key: str, t: _Transfer, event: Callable[[str], list[Action]]) -> list[Action]:
        out: list[Action] = []
        for d in sorted(t.legs):
            out += event(leg_key(key, d))
        return self._rewrite(key, out)

    def _leg_event(self, leg: str, actions: list[Action], now: float) -> list[Action]:
        key, _ = split_leg_key(leg)
        out = self._rewrite(key, actions)
        t = self.transfers.get(key)
        return out + (self._settle(key, t, now) if t is not None else [])

    def _rewrite_all(self, actions: list[Action]) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            if isinstance(action, StartWrite | Send):
                key = action.key if isinstance(action, StartWrite) else action.notice.key
                out += self._rewrite(split_leg_key(key)[0], [action])
            elif not isinstance(action, Release):  # the legs' Releases are dropped (``_settle`` releases)
                out.append(action)
        return out

    @staticmethod
    def _rewrite(key: str, actions: list[Action]) -> list[Action]:
        """Leg actions as the transfer thread performs them: notices under the pairing key, the StartWrite's
        registration too (its ``Done``); the legs' Releases are dropped (``_settle`` releases once)."""
        out: list[Action] = []
        for action in actions:
            if isinstance(action, Release):
                continue
            if isinstance(action, Send):
                action = Send(action.engine_id, replace(action.notice, key=key))
            elif isinstance(action, StartWrite):
                action = replace(action, registration=replace(action.registration, key=key))
            out.append(action)
        return out

    def _leg_over(self, key: str, d: int) -> bool:
        entry = self.legs.entries.get(leg_key(key, d))
        return entry is None or entry.state in P_TERMINAL

    def _settle(self, key: str, t: _Transfer, now: float) -> list[Action]:
        """Mark the legs that ended; release P's blocks once no leg can still write them."""
        gate = t.gate
        if gate is not None:
            for d in t.legs:
                if d not in gate.over and self._leg_over(key, d):
                    gate.on_leg_over(d)
            all_over = set(gate.targets) <= gate.over
        else:
            all_over = t.failure is not None or t.expired  # nobody registered: nothing was written
        if t.request_id is None or t.released or not all_over:
            return []
        t.released = True
        self._holding.discard(key)
        self._set_deadline(key, t, now + self.timeouts.lease_s)  # a tombstone for late registrations
        return [Release(t.request_id)]

    def _settle_holding(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key in list(self._holding):
            out += self._settle(key, self.transfers[key], now)
        return out

    def _expire_transfer(self, key: str, t: _Transfer, now: float) -> list[Action]:
        if key in self._holding and t.lease_at is not None and now >= t.lease_at:
            if t.gate is None:  # finished and nobody registered within the lease
                self.counters[Tally.EXPIRED] += 1
                t.expired = True
            else:
                t.gate.on_lease_expired()
            out = self._settle(key, t, now)
            if key in self._holding:
                self._set_deadline(key, t, now + self.timeouts.lease_s)  # running legs end by their own deadlines
            return out
        if key in self._holding or any(not self._leg_gone(key, d) for d in t.legs):
            self._set_deadline(key, t, now + self.timeouts.lease_s)
            return []
        del self.transfers[key]
        return []

    def _leg_gone(self, key: str, d: int) -> bool:
        return leg_key(key, d) not in self.legs.entries

    def _hold(self, key: str, t: _Transfer) -> None:
        if not t.released:
            self._holding.add(key)

    def _set_deadline(self, key: str, t: _Transfer, deadline: float) -> None:
        t.deadline = deadline
        self._deadlines.push(key, deadline)

    def _deadline_of(self, key: str) -> float | None:
        t = self.transfers.get(key)
        return None if t is None else t.deadline
