"""Worker membership and health per role: load counters, legs in flight, learned prefill identities, probes.

A server with data-parallel ranks (`WorkerSpec.dp_size` > 1) is one worker with a `RankSet` (router/workers/ranks.py):
identities, legs in flight, load and ejection per rank. A rank that fails is held out alone; the worker stays a
candidate while one of its ranks is usable."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from router.domain import EngineLoad, NixlIdentity, Role, Sleep, WorkerSpec, WorkerView
from router.errors import UpstreamError
from router.metrics import Metrics
from router.workers.health import HealthPolicy, WorkerHealth, stalled
from router.workers.ranks import RankPick, RankSet

logger = logging.getLogger("kvpush.pool")

_STALLED = "stalled: up to its probes but answered no leg within the stall budget (health.stalled)"
ProbeErrorHook = Callable[[WorkerSpec, BaseException], None]  # a probe raised something that is not HTTP's


class Loss(enum.StrEnum):
    """Why a leg's worker was lost while the leg ran."""

    DOWN = "down"  # ejected: a failed probe, or passive health
    DRAINED = "drained"  # an operator drained it
    REMOVED = "removed"  # it left the pool (discovery, admin)


@dataclass(eq=False)
class Tracked:
    """One leg in flight on a worker. It is lost at once when that worker goes down (probe or passive
    ejection), is drained or leaves the pool while the leg runs (or already had when the leg began).

    The leg's listener, if any, is called synchronously from `mark_lost`: no task per leg, and no gap in which a
    loss could land on a leg that has already finished."""

    worker_id: str
    started: float = 0.0  # the pool's clock when the leg began
    tokens: int = 0  # its prompt tokens (the stall budget: health.stalled)
    rank: int | None = None  # the data-parallel rank it is pinned to, if any
    loss: Loss | None = None
    reason: str = ""  # for logs: what the probe or the failure said
    _listener: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def is_lost(self) -> bool:
        return self.loss is not None

    def listen(self, listener: Callable[[], None] | None) -> None:
        """At most one listener; None stops listening."""
        self._listener = listener

    def mark_lost(self, loss: Loss, reason: str) -> None:
        if self.loss is None:
            self.loss, self.reason = loss, reason
            if self._listener is not None:
                self._listener()


class WorkerLost(UpstreamError):
    """The leg's worker was ejected, drained or removed before the leg answered (retryable elsewhere). With no
    other worker to retry on, the client gets a 503: the service is unavailable, the request itself was fine."""

    status = 503
    type = "service_unavailable"
    kind = "worker_lost"


@contextlib.asynccontextmanager
async def unless_lost(tracked: Tracked, leg: Role) -> AsyncIterator[None]:
    """Runs the block unless the leg's worker is lost first; then the block is cancelled and WorkerLost raised.

    The loss cancels the task only while it is suspended inside the block (the listener is called synchronously
    and removed on the way out), so a cancellation can never land on whatever the task does next."""
    task = asyncio.current_task()
    assert task is not None
    if tracked.is_lost:
        raise WorkerLost(f"was out of rotation ({tracked.reason})", leg=leg, worker=tracked.worker_id)
    fired = False

    def fire() -> None:
        nonlocal fired
        if asyncio.current_task() is not task:  # the task itself marking its own worker: it is not waiting
            fired = True
            task.cancel()

    tracked.listen(fire)
    try:
        yield
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:
            raise WorkerLost(
                f"was taken out of rotation before it answered ({tracked.loss})", leg=leg, worker=tracked.worker_id
            ) from None
        raise
    else:
        if fired:  # the block swallowed the cancellation and finished: the request goes on, uncancelled
            task.uncancel()
    finally:
        tracked.listen(None)


@dataclass
class WorkerState:
    """One worker's live state. Owned by the event loop thread; never shared across threads."""

    spec: WorkerSpec
    health: WorkerHealth
    ranks: RankSet
    in_flight: int = 0
    outstanding_tokens: int = 0
    load: EngineLoad | None = None  # from the last good scrape of its /metrics
    block_size: int | None = None  # its KV block size, from the last scrape that stated it
    draining: bool = False  # an operator asked: no new requests
    legs: set[Tracked] = field(default_factory=set)  # legs in flight on it, told when it is lost
    last_answer: float = 0.0  # when a leg on it last succeeded (the pool's clock): the stall rule's progress
    rank_answers: dict[int, float] = field(default_factory=dict)  # the same per data-parallel rank

    @property
    def identity(self) -> NixlIdentity | None:
        """The NIXL identity of a server without data parallelism (configured or learned); with ranks, each
        rank has its own: `ranks.identity(r)`."""
        return self.ranks.identity(0) if self.spec.dp_size == 1 else None

    @property
    def healthy(self) -> bool:
        return self.health.usable

    def view(self) -> WorkerView:
        load = self.load
        return WorkerView(
            id=self.spec.id,
            in_flight=self.in_flight,
            outstanding_tokens=self.outstanding_tokens,
            engine_running=load.running if load else 0,
            engine_waiting=load.waiting if load else 0,
            kv_usage=load.kv_usage if load else 0.0,
            load_known=load is not None,
        )


class Pool:
    """Both pools. Selection reads `candidates`; dispatch wraps each leg in `track` and reports its outcome."""

    def __init__(
        self,
        workers: Sequence[WorkerSpec],
        metrics: Metrics,
        policy: HealthPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        """`on_gone(worker_id)` is told each time a worker goes down (probe or passive ejection) or leaves the
        pool: what it cached is not to be counted on (the P/D decider forgets it). A drain is not a loss of cache."""
        self._metrics = metrics
        self._policy = policy or HealthPolicy()
        self._clock = clock
        self._on_gone = on_gone
        self._workers: dict[str, WorkerState] = {}
        for spec in workers:
            self._add(spec)
        self._publish_pools()

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerState:
        return self._workers[worker_id]

    def members(self, role: Role) -> list[WorkerSpec]:
        return [s.spec for s in self._workers.values() if s.spec.role is role]

    def all_members(self) -> list[WorkerSpec]:
        return [s.spec for s in self._workers.values()]

    def candidates(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[WorkerView]:
        now = self._clock()
        return [
            s.view()
            for s in self._workers.values()
            if s.spec.role is role
            and s.healthy
            and not s.draining
            and s.spec.id not in exclude
            and s.ranks.has_usable(now)
        ]

    def ready(self, *, prefill_needed: bool = True) -> bool:
        """A usable decode worker, and a usable prefill worker unless `prefill_needed` is False (the decode-only
        fallback serves without one). The router's /ready adds its own drain state to this."""
        return bool(self.candidates(Role.DECODE)) and (not prefill_needed or bool(self.candidates(Role.PREFILL)))

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "url": s.spec.url,
                "role": str(s.spec.role),
                "healthy": s.healthy,
                "state": s.health.state.value,
                "draining": s.draining,
                "in_flight": s.in_flight,
                "identity": None if s.identity is None else s.identity.engine_id,
                "ranks": None
                if s.spec.dp_size == 1
                else [
                    {"rank": v.rank, "usable": v.usable, "in_flight": v.in_flight} for v in s.ranks.views(self._clock())
                ],
                "load": None
                if s.load is None
                else {"running": s.load.running, "waiting": s.load.waiting, "kv_usage": s.load.kv_usage},
            }
            for s in self._workers.values()
        ]

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        """Replaces one role's membership (discovery, admin). Kept workers keep their state; new ones start
        unknown until probed; removed ones leave at once (legs in flight on them finish on their own)."""
        wanted = {s.id: s for s in specs if s.role is role}
        for worker_id, state in list(self._workers.items()):
            if state.spec.role is role and (worker_id not in wanted or wanted[worker_id] != state.spec):
                self.remove(worker_id)
        for spec in wanted.values():
            if spec.id not in self._workers:
                self._add(spec)
        self._publish_pools()

    def add(self, spec: WorkerSpec) -> bool:
        """Adds one worker (admin); False when its URL is already a member."""
        if spec.id in self._workers:
            return False
        self._add(spec)
        self._publish_pools()
        return True

    def remove(self, worker_id: str) -> bool:
        state = self._workers.pop(worker_id, None)
        if state is None:
            return False
        logger.info("%s worker %s left the pool", state.spec.role, worker_id)
        self._lose(state, Loss.REMOVED, "left the pool")
        self._gone(worker_id)
        for gauge in (self._metrics.healthy, self._metrics.in_flight):
            gauge.remove(str(state.spec.role), worker_id)
        self._publish_pools()
        return True

    def drain(self, worker_id: str) -> bool:
        state = self._workers.get(worker_id)
        if state is None:
            return False
        state.draining = True
        self._lose(state, Loss.DRAINED, "drained by an operator")
        self._publish(state)
        return True

    @contextmanager
    def track(self, worker_id: str, tokens: int, rank: int | None = None) -> Iterator[Tracked]:
        """Counts one leg as in flight on the worker (and on `rank`, when the leg is pinned to one) for the
        duration of the block. The leg is marked lost when the worker goes down, is drained or leaves while the
        leg runs."""
        state = self._workers[worker_id]  # held: the worker may leave the pool while the leg runs
        leg = Tracked(worker_id, started=self._clock(), tokens=tokens, rank=rank)
        state.in_flight += 1
        state.outstanding_tokens += tokens
        state.legs.add(leg)
        self._publish_load(state)
        if self._workers.get(worker_id) is not state or state.draining or not state.healthy:
            self._lose(state, Loss.DOWN if not state.healthy else Loss.DRAINED, "not usable when the leg began")
        try:
            with state.ranks.track(rank) if rank is not None else contextlib.nullcontext():
                yield leg
        finally:
            state.legs.discard(leg)
            state.in_flight -= 1
            state.outstanding_tokens -= tokens
            self._publish_load(state)

    def pin_rank(self, worker_id: str, pick: RankPick) -> int | None:
        """The rank the next leg to this worker is pinned to (None: a server without data parallelism). Raises
        ranks.NoUsableRank when every rank is held out."""
        state = self._workers[worker_id]
        return None if state.spec.dp_size == 1 else state.ranks.choose(self._clock(), pick)

    def learn_identity(self, worker_id: str, identity: NixlIdentity, rank: int | None = None) -> str | None:
        """A prefill answer stated `identity` for a leg pinned to `rank`: kept as that rank's (or the server's)
        identity. Returns why it cannot be kept (router/workers/ranks.py `RankSet.learn`), or None."""
        state = self._workers.get(worker_id)
        if state is None:
            return None
        if state.ranks.identity(rank or 0) == identity:
            return None
        why = state.ranks.learn(identity, rank)
        if why is None:
            logger.info("prefill %s: learned NIXL identity %s", worker_id, identity)
        return why

    def set_load(
        self,
        worker_id: str,
        load: EngineLoad | None,
        ranks: Mapping[int, EngineLoad] | None = None,
        block_size: int | None = None,
    ) -> None:
        """The worker's load from its last scrape (None: the scrape failed), each rank's, its block size."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.load = load
            state.ranks.set_loads(ranks if load is not None else None)
            if block_size is not None:
                state.block_size = block_size

    def report_rank(self, worker_id: str, rank: int, *, ok: bool, hard: bool = False, reason: str = "") -> None:
        """A pinned leg's outcome on one rank: that rank's passive health (the worker's own is not touched)."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        if ok:
            state.rank_answers[rank] = self._clock()
        if state.ranks.report(rank, self._clock(), ok=ok, hard=hard):
            logger.warning("%s worker %s: data-parallel rank %d held out: %s", state.spec.role, worker_id, rank, reason)

    def report(self, worker_id: str, *, ok: bool, hard: bool = False, reason: str = "") -> None:
        """A leg's outcome on the worker: passive health."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        now = self._clock()
        if ok:
            state.health.on_request_ok(now)
            state.last_answer = now
            return
        if state.health.on_request_failed(now, hard=hard):
            logger.warning(
                "%s worker %s ejected for %.1f s: %s", state.spec.role, worker_id, state.health.held_until - now, reason
            )
            self._metrics.ejections.labels(str(state.spec.role)).inc()
            self._lose(state, Loss.DOWN, f"ejected: {reason}")
            self._gone(worker_id)
            self._publish(state)

    async def probe_all(
        self, client: httpx.AsyncClient, timeout: float, *, on_error: ProbeErrorHook | None = None
    ) -> None:
        """Probes every worker once, at the same time (a timed-out probe of an UP worker is confirmed at once).
        A probe that raises anything counts as failed; `on_error` hears of those that are not HTTP errors."""
        workers = list(self._workers.values())
        await asyncio.gather(*(self._probe(client, s, timeout, on_error) for s in workers))
        self.check_stalls()

    def check_stalls(self) -> None:
        """Ejects every prefill worker (or, with data parallelism, every rank) that `health.stalled` says makes no
        progress: up to its probes, answering none of its legs. Run on every health round."""
        now = self._clock()
        for state in list(self._workers.values()):
            if state.spec.role is not Role.PREFILL or not state.healthy:
                continue
            if state.spec.dp_size > 1:
                self._check_rank_stalls(state, now)
                continue
            legs = [(leg.started, leg.tokens) for leg in state.legs if not leg.is_lost]
            if stalled(legs, state.last_answer, now, self._policy):
                self.report(state.spec.id, ok=False, hard=True, reason=_STALLED)

    def _check_rank_stalls(self, state: WorkerState, now: float) -> None:
        for rank in sorted({leg.rank for leg in state.legs if leg.rank is not None and not leg.is_lost}):
            legs = [(leg.started, leg.tokens) for leg in state.legs if leg.rank == rank and not leg.is_lost]
            if stalled(legs, state.rank_answers.get(rank, 0.0), now, self._policy):
                self.report_rank(state.spec.id, rank, ok=False, hard=True, reason=_STALLED)
                for leg in list(state.legs):
                    if leg.rank == rank:
                        leg.mark_lost(Loss.DOWN, f"rank {rank} held out: {_STALLED}")

    async def run_health(
        self,
        client: httpx.AsyncClient,
        interval: float,
        timeout: float,
        *,
        on_error: ProbeErrorHook | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """Probes every worker's /health forever, a round starting every `interval` seconds (or at once when the
        last round took longer). Cancel to stop."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.probe_all(client, timeout, on_error=on_error)
            await sleep(max(0.0, interval - (loop.time() - started)))

    async def _probe(
        self, client: httpx.AsyncClient, state: WorkerState, timeout: float, on_error: ProbeErrorHook | None
    ) -> None:
        while True:
            ok, timed_out, reason = await _check_health(client, state.spec, timeout, on_error)
            now = self._clock()
            changed = state.health.on_probe_ok(now) if ok else state.health.on_probe_failed(now, timed_out=timed_out)
            if not state.health.confirming:
                break
            logger.info("%s worker %s: probe timed out; probing again at once", state.spec.role, state.spec.id)
        if changed:
            log = logger.info if ok else logger.warning
            log("%s worker %s is %s (%s)", state.spec.role, state.spec.id, "up" if ok else "down", reason)
            if not ok:
                self._gone(state.spec.id)
        if not state.healthy:
            self._lose(state, Loss.DOWN, f"health probe: {reason}")
        self._publish(state)

    def _gone(self, worker_id: str) -> None:
        if self._on_gone is not None:
            self._on_gone(worker_id)

    def _lose(self, state: WorkerState, loss: Loss, reason: str) -> None:
        for leg in list(state.legs):
            leg.mark_lost(loss, reason)

    def _add(self, spec: WorkerSpec) -> None:
        logger.info("%s worker %s joined the pool", spec.role, spec.id)
        ranks = RankSet(spec.dp_size, self._policy, configured=spec.identity)
        self._workers[spec.id] = WorkerState(spec, WorkerHealth(self._policy), ranks)
        self._publish(self._workers[spec.id])

    def _publish(self, state: WorkerState) -> None:
        if self._workers.get(state.spec.id) is state:
            usable = state.healthy and not state.draining
            self._metrics.healthy.labels(str(state.spec.role), state.spec.id).set(1 if usable else 0)
            self._publish_pools()

    def _publish_load(self, state: WorkerState) -> None:
        if self._workers.get(state.spec.id) is state:
            self._metrics.in_flight.labels(str(state.spec.role), state.spec.id).set(state.in_flight)

    def _publish_pools(self) -> None:
        for role in Role:
            members = [s for s in self._workers.values() if s.spec.role is role]
            self._metrics.pool_members.labels(str(role)).set(len(members))
            self._metrics.pool_healthy.labels(str(role)).set(sum(1 for s in members if s.healthy and not s.draining))


async def _check_health(
    client: httpx.AsyncClient, spec: WorkerSpec, timeout: float, on_error: ProbeErrorHook | None
) -> tuple[bool, bool, str]:
    """One GET /health under a whole-request deadline: (answered 2xx, timed out, what happened)."""
    try:
        async with asyncio.timeout(timeout):  # whole request; httpx's own timeouts are per phase
            response = await client.get(f"{spec.url}/health", timeout=timeout)
    except (TimeoutError, httpx.TimeoutException) as exc:
        return False, True, f"no answer within {timeout:g} s ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        return False, False, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a bug below us (a URL the transport refuses) fails this probe, not the loop
        logger.warning("%s worker %s: probe raised %s: %s", spec.role, spec.id, type(exc).__name__, exc)
        if on_error is not None:
            on_error(spec, exc)
        return False, False, f"{type(exc).__name__}: {exc}"
    return response.is_success, False, f"HTTP {response.status_code}"
