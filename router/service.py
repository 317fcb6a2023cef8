"""The router's parts wired together (no HTTP framework): pools, dispatcher, admission, background loops, drain."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from router.admission import Admission
from router.config import Settings
from router.discovery.build import build_source
from router.discovery.settings import parse_discovery
from router.dispatch import Dispatcher
from router.domain import Role
from router.health import HealthPolicy
from router.metrics import Metrics
from router.pool import Pool
from router.scrape import Scraper
from router.timings import TimingLog
from router.upstream import make_client

logger = logging.getLogger("kvpush.service")


class Service:
    """Everything one router process holds. Built by create_app; `start`/`stop` run in the app's lifespan."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        policy = HealthPolicy(settings.eject_after, settings.eject_backoff, settings.eject_backoff_max)
        self.pool = Pool((*settings.prefill, *settings.decode), self.metrics, policy, clock)
        self.timings = TimingLog(settings.timings_capacity)
        self.client = make_client(settings, transport)
        self.dispatcher = Dispatcher(settings, self.pool, self.client, self.metrics, self.timings, clock)
        self.admission = Admission(
            settings.max_in_flight, settings.admission_queue, settings.admission_wait, self.metrics
        )
        self.draining = False
        self._loops: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """First probe of every worker, then the health, discovery and scrape loops."""
        s, metrics = self.settings, self.metrics
        await self.pool.probe_all(self.client, s.timeouts.health)
        self._spawn(self.pool.run_health(self.client, s.health_interval, s.timeouts.health))
        for config in parse_discovery(s.discovery):
            source = build_source(config, on_error=lambda role, _: metrics.discovery_errors.labels(str(role)).inc())
            self._spawn(source.run(self.pool))
        if s.scrape_interval > 0:
            scraper = Scraper(
                self.client,
                self.pool.all_members,
                self.pool,
                interval=s.scrape_interval,
                timeout=s.timeouts.health,
                on_error=lambda spec, _: metrics.scrape_errors.labels(str(spec.role)).inc(),
            )
            self._spawn(scraper.run())

    async def stop(self) -> None:
        for task in self._loops:
            task.cancel()
        if self._loops:
            await asyncio.wait(self._loops)
        await self.dispatcher.aclose()
        await self.client.aclose()

    def begin_drain(self) -> None:
        """SIGTERM: /ready answers 503 from now on, so load balancers stop sending."""
        if not self.draining:
            logger.info("draining: /ready answers 503 from now on")
        self.draining = True
        self.metrics.draining.set(1)

    def ready(self) -> bool:
        """Both pools have a healthy worker (or decode alone, with the decode-only fallback), and no drain."""
        decode = bool(self.pool.candidates(Role.DECODE))
        prefill = bool(self.pool.candidates(Role.PREFILL)) or self.settings.fallback == "decode-only"
        return decode and prefill and not self.draining

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._loops.add(asyncio.create_task(work))
