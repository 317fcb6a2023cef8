"""The data-parallel ranks of one vLLM server: their NIXL identities, the rank a leg is pinned to, each rank's
load and its ejection. Pure (the caller passes its monotonic clock as `now`).

A vLLM server started with `--data-parallel-size N` is one HTTP endpoint with N engine ranks. Each rank is an
engine of its own: its NIXL engine id is `<engine_id>_dp<r>` and its side channel listens on the server's base
port + r (vLLM's `v1/engine/core.py` and the NIXL connector's `base_scheduler.py`); kvpush's connector runs one
side channel per worker rank, so its DP engine r starts at base + r x TP x PP (`rank_identity`, by the
configured `connector` kind). The server's API process picks the rank of a request unless the request names
one in the `X-data-parallel-rank` header. A push router therefore pins prefill's rank with that header and gives
decode that very rank's identity; it pins decode's rank only when it chooses by load (per-rank load from the
server's /metrics, `rank_metrics.py`), and otherwise leaves decode's rank to the server.

A rank that fails is ejected alone (`RankHealth`: held out for a backoff that doubles per ejection in a row, then
let back in on trust; a success resets it). A server whose every rank is held out has no usable rank; the
worker itself stays up (its /health is the API process's, shared by every rank).

    RankHealth:  UP ──hard failure / eject_after soft failures in a row──▶ HELD (until held_until)
                 HELD ──now ≥ held_until──▶ UP (on trust; the next failure holds it twice as long)
                 any success ──▶ UP, streaks reset
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from router.domain import ConnectorKind, EngineLoad, NixlIdentity
from router.workers.health import HealthPolicy

__all__ = [
    "MAX_DP_SIZE",
    "RANK_HEADER",
    "NoUsableRank",
    "RankHealth",
    "RankPick",
    "RankSet",
    "RankView",
    "rank_headers",
    "rank_identity",
    "split_rank",
    "stated_rank",
]

RANK_HEADER = "x-data-parallel-rank"  # vLLM reads it case-insensitively (`X-data-parallel-rank` in its docs)
MAX_DP_SIZE = 1024  # a sanity bound on --data-parallel-size as configured or stated
_SUFFIX = re.compile(r"^(?P<base>.+)_dp(?P<rank>0|[1-9][0-9]{0,3})$")


class NoUsableRank(LookupError):
    """Every rank of the server is held out after failures."""


def rank_identity(base: NixlIdentity, rank: int, dp_size: int) -> NixlIdentity:
    """Rank `rank`'s identity on a server whose base identity (as configured: the engine id and side port vLLM was
    started with) is `base`. A server without data parallelism (dp_size 1) is its base identity, unsuffixed.

    The port is the DP engine's first side channel: upstream's connectors run one per DP engine (base + rank);
    kvpush's runs one per worker rank, so DP engine `rank` starts at base + rank x TP x PP (its rank (0, 0);
    decode derives the other ranks' ports from it and `tp_size`)."""
    _check_rank(rank, dp_size)
    if dp_size == 1:
        return base
    stride = base.tp_size * base.pp_size if base.connector is ConnectorKind.KVPUSH else 1
    return dataclasses.replace(base, engine_id=f"{base.engine_id}_dp{rank}", port=base.port + rank * stride)


def split_rank(engine_id: str) -> tuple[str, int | None]:
    """An engine id as a rank states it → (the server's engine id, the rank), or (engine_id, None) unsuffixed."""
    match = _SUFFIX.match(engine_id)
    if match is None:
        return engine_id, None
    return match["base"], int(match["rank"])


def stated_rank(stated: NixlIdentity) -> int | None:
    """The rank a prefill answer's identity names (its engine id's `_dp<r>`), or None when unsuffixed."""
    return split_rank(stated.engine_id)[1]


def rank_headers(rank: int | None) -> dict[str, str]:
    """The header that pins a leg to `rank` (nothing when the server chooses)."""
    return {} if rank is None else {RANK_HEADER: str(rank)}


def _check_rank(rank: int, dp_size: int) -> None:
    if not 1 <= dp_size <= MAX_DP_SIZE:
        raise ValueError(f"data-parallel size {dp_size} is outside 1..{MAX_DP_SIZE}")
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside 0..{dp_size - 1}")


class RankPick(enum.StrEnum):
    """How a rank is chosen among the usable ones."""

    ROUND_ROBIN = "round-robin"  # in turn (even spread under uniform load)
    LEAST_LOADED = "least-loaded"  # fewest legs through this router + the rank's own running and waiting


class RankState(enum.Enum):
    UP = "up"
    HELD = "held"  # ejected after failures, until held_until


class RankHealth:
    """One rank's passive health. Events in, state out; `now` is the caller's monotonic clock in seconds."""

    def __init__(self, policy: HealthPolicy) -> None:
        self._policy = policy
        self.state = RankState.UP
        self.failures = 0  # soft failures in a row
        self.ejections = 0  # ejections in a row (sets the backoff)
        self.held_until = 0.0

    def usable(self, now: float) -> bool:
        if self.state is RankState.HELD and now >= self.held_until:
            self.state = RankState.UP  # on trust: the next failure holds it out twice as long
        return self.state is RankState.UP

    def on_ok(self) -> None:
        self.state = RankState.UP
        self.failures = 0
        self.ejections = 0

    def on_failed(self, now: float, *, hard: bool) -> bool:
        """A leg pinned to this rank failed. Returns True when this ejected the rank."""
        if not self.usable(now):
            return False
        self.failures += 1
        if not (hard or self.failures >= self._policy.eject_after):
            return False
        self.ejections += 1
        backoff = min(self._policy.max_backoff, self._policy.base_backoff * 2 ** (self.ejections - 1))
        self.state = RankState.HELD
        self.held_until = now + backoff
        self.failures = 0
        return True


@dataclass(frozen=True)
class RankView:
    """One rank as the chooser and /debug see it."""

    rank: int
    usable: bool
    in_flight: int  # legs pinned to it through this router
    engine_running: int = 0  # from the last scrape, when load_known
    engine_waiting: int = 0
    load_known: bool = False

    @property
    def load(self) -> int:
        return self.in_flight + self.engine_running + self.engine_waiting


class RankSet:
    """The ranks of one server: identities (configured base or learned per rank), legs in flight, load, health.

    Owned by the event loop thread, like the worker state that holds it."""

    def __init__(self, dp_size: int, policy: HealthPolicy, *, configured: NixlIdentity | None = None) -> None:
        _check_rank(0, dp_size)
        if configured is not None and split_rank(configured.engine_id)[1] is not None and dp_size > 1:
            raise ValueError(
                f"engine id {configured.engine_id!r} already names a rank: configure the server's own engine id "
                "(the one vLLM was started with); the router adds _dp<r> per rank"
            )
        self.dp_size = dp_size
        self.configured = configured
        self._learned: dict[int, NixlIdentity] = {}
        self._health = [RankHealth(policy) for _ in range(dp_size)]
        self._in_flight = [0] * dp_size
        self._loads: dict[int, EngineLoad] = {}
        self._cursor = 0  # round-robin position (also breaks least-loaded ties fairly)

    # identities -------------------------------------------------------------------------------------------------

    def identity(self, rank: int) -> NixlIdentity | None:
        """Rank `rank`'s NIXL identity: derived from the configured base, else as that rank last stated it."""
        _check_rank(rank, self.dp_size)
        if self.configured is not None:
            return rank_identity(self.configured, rank, self.dp_size)
        return self._learned.get(rank)

    def learn(self, stated: NixlIdentity, pinned: int | None) -> str | None:
        """A prefill answer stated `stated` for a leg pinned to `pinned` (None: not pinned, dp_size 1). Keeps it
        as that rank's identity; returns why it cannot be kept (the rank it names is not the pinned one, or it
        names a rank on a server without data parallelism), or None when kept."""
        named = stated_rank(stated)
        if self.dp_size == 1:
            if named is not None and pinned is None:
                return f"states rank {named} ({stated.engine_id}) but is configured with data-parallel size 1"
            self._learned[0] = stated
            return None
        if pinned is None or named != pinned:
            return (
                f"answered for rank {named} ({stated.engine_id}) a leg pinned to rank {pinned}: "
                "does the server honour the X-data-parallel-rank header?"
            )
        self._learned[pinned] = stated
        return None

    def forget(self) -> None:
        """The server restarted or left: every learned identity is stale."""
        self._learned.clear()

    # choice -----------------------------------------------------------------------------------------------------

    def views(self, now: float) -> list[RankView]:
        out = []
        for rank in range(self.dp_size):
            load = self._loads.get(rank)
            out.append(
                RankView(
                    rank=rank,
                    usable=self._health[rank].usable(now),
                    in_flight=self._in_flight[rank],
                    engine_running=load.running if load else 0,
                    engine_waiting=load.waiting if load else 0,
                    load_known=load is not None,
                )
            )
        return out

    def has_usable(self, now: float) -> bool:
        return any(h.usable(now) for h in self._health)

    def choose(self, now: float, pick: RankPick) -> int:
        """The rank for the next leg. Raises NoUsableRank when every rank is held out."""
        usable = [v for v in self.views(now) if v.usable]
        if not usable:
            raise NoUsableRank(f"all {self.dp_size} data-parallel ranks are held out after failures")
        # Fair order: the ranks from the cursor on, then those before it.
        ordered = sorted(usable, key=lambda v: (v.rank - self._cursor) % self.dp_size)
        chosen = ordered[0] if pick is RankPick.ROUND_ROBIN else min(ordered, key=lambda v: v.load)
        self._cursor = (chosen.rank + 1) % self.dp_size
        return chosen.rank

    # per-leg events ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def track(self, rank: int) -> Iterator[None]:
        """A leg pinned to `rank` is in flight for the duration of the block."""
        _check_rank(rank, self.dp_size)
        self._in_flight[rank] += 1
        try:
            yield
        finally:
            self._in_flight[rank] -= 1

    def report(self, rank: int, now: float, *, ok: bool, hard: bool = False) -> bool:
        """The outcome of a leg pinned to `rank`. Returns True when a failure ejected the rank."""
        _check_rank(rank, self.dp_size)
        if ok:
            self._health[rank].on_ok()
            return False
        return self._health[rank].on_failed(now, hard=hard)

    def set_loads(self, loads: Mapping[int, EngineLoad] | None) -> None:
        """Each rank's load from the server's last /metrics scrape (`rank_metrics.rank_loads`); None: unknown.
        Ranks the page does not name (or names beyond dp_size) are unknown."""
        self._loads = {} if loads is None else {r: v for r, v in loads.items() if 0 <= r < self.dp_size}
