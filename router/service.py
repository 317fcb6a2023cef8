"""The router's parts wired together (no HTTP framework): pools, dispatcher, admission, background loops, drain,
the KV-event subscriber (when `kv_events.enabled`), and the service work behind the non-hot routes (/v1/models
fan-out, adding and probing workers)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from router.admission import Admission
from router.config import Settings, decode_from_mapping, prefill_from_mapping
from router.decider import stats_of
from router.deciders.registry import make_decider
from router.discovery.build import build_source
from router.discovery.settings import parse_discovery
from router.dispatch import Dispatcher
from router.domain import Fallback, RequestInfo, Role, WorkerSpec
from router.errors import BadRequest, ConfigError, NoHealthyWorker
from router.gateway import GatewayPick, PrefillHeader, read_gateway_headers
from router.kv_events import membership
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber
from router.kv_events.view import KvEventReport, KvEventView
from router.legs.base import LegTransport
from router.legs.httpx import HttpxLegs
from router.loops import Supervisor
from router.metrics import Metrics
from router.timings import RequestRecord, TimingLog
from router.tracing.provider import Tracing
from router.upstream import make_client, make_legs, translate
from router.workers.health import HealthPolicy
from router.workers.pool import Pool
from router.workers.scrape import Scraper

logger = logging.getLogger("kvpush.service")


class Service:
    """Everything one router process holds. Built by create_app; `start`/`stop` run in the app's lifespan."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = tracing  # None: tracing off (router/tracing); shut down in stop()
        self.metrics = Metrics(exemplars=tracing is not None)
        policy = HealthPolicy(settings.eject_after, settings.eject_backoff, settings.eject_backoff_max)
        self.pool = Pool((*settings.prefill, *settings.decode), self.metrics, policy, clock, on_gone=self._gone)
        self.timings = TimingLog(settings.timings_capacity)
        self.client = make_client(settings, transport)
        legs: LegTransport = HttpxLegs(self.client) if transport is not None else make_legs(settings)
        kv = settings.kv_events
        self.kv_events: KvEventSubscriber | None = None  # follows every publishing worker (router/kv_events)
        view: KvEventView | None = None
        if kv.enabled:
            self.kv_events = KvEventSubscriber(KvIndex(kv.max_blocks_per_stream), kv.limits())
            view = KvEventView(self.kv_events.index, self.kv_events.status)
            self.metrics.watch_kv_events(self._kv_report)
        self._kv_refused: set[str] = set()
        decider = make_decider(settings.decider, settings.decider_options, view)
        self.metrics.watch_decider(lambda: stats_of(decider))
        self.dispatcher = Dispatcher(settings, self.pool, legs, self.metrics, self.timings, clock, decider)
        self.wants_headers = decider.wants_headers  # the HTTP layer copies client headers into requests only then
        self.gateway = settings.gateway  # behind an InferencePool: the EPP's picks come in headers (gateway.py)
        self.admission = Admission(
            settings.max_in_flight, settings.admission_queue, settings.admission_wait, self.metrics
        )
        self.draining = False
        self._loops = Supervisor(on_error=self._loop_failed)

    def gateway_pick(self, headers: Sequence[tuple[bytes, bytes]]) -> GatewayPick | None:
        """What the gateway's EPP decided for a request (None when the router is not behind one). Raises
        BadRequest (400) for a prefill named outside the pool, a malformed header, or none when required."""
        if not self.gateway.on:
            return None
        return read_gateway_headers(
            headers,
            self.pool.members(Role.PREFILL),
            require_prefill=self.gateway.prefill_header is PrefillHeader.REQUIRED,
            session_headers=self.gateway.session_headers,
        )

    def new_record(self, request_id: str, info: RequestInfo) -> RequestRecord:
        """A client request's record, started now (the HTTP layer makes one per request it accepts)."""
        return self.dispatcher.new_record(request_id, info)

    async def start(self) -> None:
        """First probe of every worker, then the health, discovery and scrape loops."""
        s, metrics = self.settings, self.metrics
        if self.kv_events is not None:
            self.follow_kv_events()
            self._loops.spawn("kv-events", self.kv_events.run)
            self._loops.spawn("kv-events-members", self._follow_kv_events_loop)
        await self.pool.probe_all(self.client, s.timeouts.health, on_error=self._probe_failed)
        self._loops.spawn(
            "health",
            lambda: self.pool.run_health(
                self.client, s.health_interval, s.timeouts.health, on_error=self._probe_failed
            ),
        )
        for config in parse_discovery(s.discovery):
            source = build_source(config, on_error=lambda role, _: metrics.discovery_errors.labels(str(role)).inc())
            self._loops.spawn(f"discovery-{config.role}", functools.partial(source.run, self.pool))
        if s.scrape_interval > 0:
            scraper = Scraper(
                self.client,
                self.pool.all_members,
                self.pool,
                interval=s.scrape_interval,
                timeout=s.timeouts.health,
                on_error=lambda spec, _: metrics.scrape_errors.labels(str(spec.role)).inc(),
            )
            self._loops.spawn("scrape", scraper.run)

    async def stop(self) -> None:
        await self._loops.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        await self.dispatcher.aclose()
        await self.client.aclose()
        if self.tracing is not None:  # the spans still queued go out, for a bounded time (off the loop)
            await asyncio.to_thread(self.tracing.shutdown)

    def begin_drain(self) -> None:
        """SIGTERM: /ready answers 503 from now on, so load balancers stop sending."""
        if not self.draining:
            logger.info("draining: /ready answers 503 from now on")
        self.draining = True
        self.metrics.draining.set(1)

    def ready(self) -> bool:
        """Both pools have a healthy worker (or decode alone, with the decode-only fallback), every background
        loop is alive, and no drain."""
        workers = self.pool.ready(prefill_needed=self.settings.fallback != Fallback.DECODE_ONLY)
        return workers and self._loops.alive() and not self.draining

    async def models(self) -> bytes:
        """The first healthy decode worker's /v1/models answer."""
        for view in self.pool.candidates(Role.DECODE):
            url = f"{self.pool.get(view.id).spec.url}/v1/models"
            try:
                answer = await self.client.get(url, timeout=self.settings.timeouts.health)
            except httpx.HTTPError as exc:
                logger.warning("GET %s: %s", url, translate(exc, leg=Role.DECODE, worker=view.id))
                continue
            if answer.is_success:
                return answer.content
        raise NoHealthyWorker("no healthy decode worker answered /v1/models")

    async def add_worker(self, body: Mapping[str, Any]) -> tuple[bool, str]:
        """An admin's new worker from typed JSON fields ({"role", "url", prefill identity fields}); probed at once.
        Returns (added, url); False when the URL is already a member."""
        role = body.get("role")
        fields = {k: v for k, v in body.items() if k != "role"}
        where = f"admin: new {role} worker"
        try:
            if role == "prefill":
                spec: WorkerSpec = prefill_from_mapping(fields, where=where)
            elif role == "decode":
                spec = decode_from_mapping(fields, where=where)
            else:
                raise BadRequest("'role' must be 'prefill' or 'decode'")
        except ConfigError as bad:
            raise BadRequest(str(bad)) from None
        if str(spec.role) in self.settings.discovery:
            raise BadRequest(f"{spec.role} workers come from discovery here; add them there, not by hand")
        added = self.pool.add(spec)
        if self.kv_events is not None:
            self.follow_kv_events()
        await self.pool.probe_all(self.client, self.settings.timeouts.health, on_error=self._probe_failed)
        return added, spec.url

    def remove_worker(self, url: str) -> bool:
        return self.pool.remove(url)  # the pool tells _gone, and the decider forgets the worker

    def follow_kv_events(self) -> None:
        """The subscriber follows exactly the pool's publishing workers (called at start, when a worker is added
        or leaves, and once a health interval for what discovery changed)."""
        sub = self.kv_events
        if sub is None:
            return
        plan = membership.plan(self.settings.kv_events, self.pool.all_members(), sub.following())
        for worker in plan.remove:
            sub.remove(worker)
        sub.add(plan.add)
        for refusal in set(plan.refused) - self._kv_refused:
            logger.warning("kv events: not following %s", refusal)
        self._kv_refused = set(plan.refused)

    async def _follow_kv_events_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            self.follow_kv_events()

    def _kv_report(self) -> KvEventReport:
        sub = self.kv_events
        if sub is None:
            return KvEventReport({}, {})
        workers = {}
        for worker in sub.workers():
            streams = sub.status(worker)
            workers[worker] = (all(x.caught_up for x in streams), sum(x.blocks for x in streams))
        return KvEventReport(sub.counters(), workers)

    def _gone(self, worker_id: str) -> None:
        """A worker went down or left the pool (probe, passive ejection, discovery, admin). One that left is no
        longer followed; one that went down still is (its publisher's dropped connection says if it restarted)."""
        self.dispatcher.forget(worker_id)
        if self.kv_events is not None and worker_id not in self.pool:
            self.kv_events.remove(worker_id)

    def _probe_failed(self, spec: WorkerSpec, error: BaseException) -> None:
        self.metrics.loop_errors.labels("health").inc()

    def _loop_failed(self, name: str, error: BaseException) -> None:
        self.metrics.loop_errors.labels(name).inc()
