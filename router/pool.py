"""Worker membership and health per role: load counters, learned prefill identities, probes, readiness."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from router.domain import NixlIdentity, Role, WorkerSpec, WorkerView
from router.metrics import Metrics

logger = logging.getLogger("kvpush.pool")


@dataclass
class WorkerState:
    """One worker's live state. Owned by the event loop thread; never shared across threads."""

    spec: WorkerSpec
    healthy: bool = False  # unknown until the first probe answers
    in_flight: int = 0
    outstanding_tokens: int = 0
    learned_identity: NixlIdentity | None = None

    @property
    def identity(self) -> NixlIdentity | None:
        return self.spec.identity or self.learned_identity

    def view(self) -> WorkerView:
        return WorkerView(id=self.spec.id, in_flight=self.in_flight, outstanding_tokens=self.outstanding_tokens)


class Pool:
    """Both pools. Selection reads `candidates`; dispatch wraps each leg in `track` and reports failures."""

    def __init__(self, workers: Sequence[WorkerSpec], metrics: Metrics) -> None:
        self._workers = {w.id: WorkerState(w) for w in workers}
        self._metrics = metrics
        for state in self._workers.values():
            self._publish(state)

    def get(self, worker_id: str) -> WorkerState:
        return self._workers[worker_id]

    def members(self, role: Role) -> list[WorkerSpec]:
        return [s.spec for s in self._workers.values() if s.spec.role is role]

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        """Replaces one role's membership (discovery). Kept workers keep their state; new ones start unknown
        until probed; removed ones leave at once (legs in flight on them finish on their own)."""
        wanted = {s.id: s for s in specs if s.role is role}
        for worker_id, state in list(self._workers.items()):
            if state.spec.role is role and (worker_id not in wanted or wanted[worker_id] != state.spec):
                logger.info("%s worker %s left the pool", role, worker_id)
                del self._workers[worker_id]
                self._metrics.healthy.remove(str(role), worker_id)
                self._metrics.in_flight.remove(str(role), worker_id)
        for worker_id, spec in wanted.items():
            if worker_id not in self._workers:
                logger.info("%s worker %s joined the pool", role, worker_id)
                self._workers[worker_id] = WorkerState(spec)
                self._publish(self._workers[worker_id])

    def candidates(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[WorkerView]:
        return [
            s.view()
            for s in self._workers.values()
            if s.spec.role is role and s.healthy and s.spec.id not in exclude
        ]

    def ready(self) -> bool:
        return all(self.candidates(role) for role in Role)

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {"url": s.spec.url, "role": str(s.spec.role), "healthy": s.healthy, "in_flight": s.in_flight,
             "identity": None if s.identity is None else s.identity.engine_id}
            for s in self._workers.values()
        ]

    @contextmanager
    def track(self, worker_id: str, tokens: int) -> Iterator[None]:
        """Counts one leg as in flight on the worker for the duration of the block."""
        state = self._workers[worker_id]  # held: the worker may leave the pool while the leg runs
        state.in_flight += 1
        state.outstanding_tokens += tokens
        self._publish_load(state)
        try:
            yield
        finally:
            state.in_flight -= 1
            state.outstanding_tokens -= tokens
            self._publish_load(state)

    def learn_identity(self, worker_id: str, identity: NixlIdentity) -> None:
        state = self._workers.get(worker_id)
        if state is None:
            return
        if state.learned_identity != identity:
            logger.info("prefill %s: learned NIXL identity %s", worker_id, identity)
        state.learned_identity = identity

    def mark_down(self, worker_id: str, reason: str) -> None:
        """Passive ejection: the worker failed a connection; the next good probe brings it back."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        if state.healthy:
            logger.warning("%s worker %s marked down: %s", state.spec.role, worker_id, reason)
        state.healthy = False
        self._publish(state)

    async def probe_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self._probe(client, s, timeout) for s in list(self._workers.values())))

    async def run_health(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Probes every worker's /health forever, `interval` seconds apart. Cancel to stop."""
        while True:
            await self.probe_all(client, timeout)
            await asyncio.sleep(interval)

    async def _probe(self, client: httpx.AsyncClient, state: WorkerState, timeout: float) -> None:
        try:
            response = await client.get(f"{state.spec.url}/health", timeout=timeout)
            ok, reason = response.is_success, f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok != state.healthy:
            log = logger.info if ok else logger.warning
            log("%s worker %s is %s (%s)", state.spec.role, state.spec.id, "up" if ok else "down", reason)
        state.healthy = ok
        self._publish(state)

    def _publish(self, state: WorkerState) -> None:
        if self._workers.get(state.spec.id) is state:
            self._metrics.healthy.labels(str(state.spec.role), state.spec.id).set(1 if state.healthy else 0)

    def _publish_load(self, state: WorkerState) -> None:
        if self._workers.get(state.spec.id) is state:
            self._metrics.in_flight.labels(str(state.spec.role), state.spec.id).set(state.in_flight)
