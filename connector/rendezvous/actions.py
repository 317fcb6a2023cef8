"""What the rendezvous machines ask of the transfer thread (actions), their counters (``Tally``),
their leases (``Timeouts``) and the deadline heap both machines use.

Pure: no vLLM, NIXL, torch or threading. ``connector.rendezvous.prefill`` re-exports every name here.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from dataclasses import dataclass

from connector.wire.metadata import Notice, PeerAddress, Registration


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
    FENCE_TIMEOUTS = "fence_timeouts"
    FENCED = "fenced"
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
    WRITES_POSTED = "writes_posted"
    PARTIAL_WRITES = "partial_writes"
    WRITTEN = "written"


@dataclass(frozen=True)
class Timeouts:
    """Every lease of the protocol, in seconds."""

    lease_s: float = 30.0  # P: finished blocks wait this long for a registration; tombstones live this long
    kv_timeout_s: float = 120.0  # D: how long a registered request waits for its KV
    write_grace_s: float = 40.0  # D: P's last WRITE may start this long before D's hold deadline
    # P: a WRITE still running after this is abandoned (< write_grace_s). It must exceed the slowest WRITE:
    # the whole prompt over the slowest link (stack's 25g-like preset: 16 MiB in 4.7 s, about 4 prefills).
    write_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0  # D: handshake with P must finish within this

    def __post_init__(self) -> None:
        if not 0 < self.write_timeout_s < self.write_grace_s < self.kv_timeout_s:
            raise ValueError("need 0 < write_timeout_s < write_grace_s < kv_timeout_s")

    @classmethod
    def derived(cls, **given: float) -> Timeouts:
        """The leases with the WRITE windows that were not given scaled down to fit a shorter ``kv_timeout_s``.

        The defaults keep write_grace_s at a third of kv_timeout_s and write_timeout_s at three quarters of the
        grace; a deployment that shortens kv_timeout_s (a fault bed, a test) keeps those proportions instead of
        being refused for defaults it never set. Given values are kept as they are (and checked).
        """
        kv = given.get("kv_timeout_s", cls.kv_timeout_s)
        if "write_grace_s" not in given:
            given["write_grace_s"] = min(cls.write_grace_s, kv / 3)
        if "write_timeout_s" not in given:
            given["write_timeout_s"] = min(cls.write_timeout_s, given["write_grace_s"] * 0.75)
        return cls(**given)


# --------------------------------------------------------------------------------------------
# Actions (what the caller must do)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWrite:
    """P: WRITE ``local_blocks`` into ``remote_blocks`` (None: the registration's blocks, tails aligned);
    a ``final`` WRITE carries the notice ``Done``, a partial one (progressive push, G14) none."""

    key: str
    request_id: str
    local_blocks: tuple[int, ...]
    registration: Registration
    remote_blocks: tuple[int, ...] | None = None
    final: bool = True
    ordinal: int = 1  # the how-manieth WRITE of this transfer (1 = the first)


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
