"""Engine load scraping: each worker's vLLM /metrics read on an interval, parsed into an EngineLoad (plus each
data-parallel rank's and the KV block size: router/workers/rank_metrics.py), sunk."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from router.domain import EngineLoad, Sleep, WorkerSpec
from router.workers.rank_metrics import (
    KV_USAGE,
    RUNNING,
    WAITING,
    MetricsPageError,
    block_size,
    closing_brace,
    rank_loads,
)

__all__ = ["EngineLoad", "LoadSink", "ScrapeError", "Scraper", "parse_engine_load", "samples"]

logger = logging.getLogger("kvpush.scrape")

_WANTED = (RUNNING, WAITING, *KV_USAGE)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class ScrapeError(ValueError):
    """A /metrics page without the vLLM gauges, or with malformed lines."""


class LoadSink(Protocol):
    def set_load(
        self,
        worker_id: str,
        load: EngineLoad | None,
        ranks: Mapping[int, EngineLoad] | None = None,
        block_size: int | None = None,
    ) -> None:
        """`load` is None when the worker's scrape failed (its load is unknown); `ranks` each engine index's
        load; `block_size` the KV block size the page states."""
        ...


@dataclass(frozen=True)
class PageFacts:
    """What one /metrics page says: the worker's load, each rank's, its KV block size."""

    load: EngineLoad
    ranks: Mapping[int, EngineLoad]
    block_size: int | None


def parse_page(text: str) -> PageFacts:
    """Raises ScrapeError for a page that is not a vLLM engine's or not the Prometheus text format."""
    try:
        return PageFacts(parse_engine_load(text), rank_loads(text), block_size(text))
    except MetricsPageError as error:
        raise ScrapeError(str(error)) from None


ScrapeErrorHook = Callable[[WorkerSpec, str], None]


def _labels_end(line: str, start: int) -> int:
    """Index just past the `}` closing the label set that opens at `start`; quoted values may hold `}`."""
    end = closing_brace(line[start:])
    if end == -1:
        raise ScrapeError(f"unclosed label set: {line[:200]!r}")
    return start + end + 1


def samples(text: str) -> Iterator[tuple[str, float]]:
    """(metric name, value) for each sample line of the Prometheus text format; labels and timestamps dropped."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _NAME.match(line)
        if match is None:
            raise ScrapeError(f"not a sample line: {line[:200]!r}")
        end = _labels_end(line, match.end()) if line[match.end() : match.end() + 1] == "{" else match.end()
        fields = line[end:].split()
        if not fields:
            raise ScrapeError(f"a sample without a value: {line[:200]!r}")
        try:
            yield match.group(), float(fields[0])
        except ValueError:
            raise ScrapeError(f"a sample value that is not a number: {line[:200]!r}") from None


def parse_engine_load(text: str) -> EngineLoad:
    """The load in one vLLM /metrics page: requests running and waiting summed over its engines, KV-cache usage
    the mean over them (a fraction). Raises ScrapeError when the running/waiting gauges are absent."""
    found: dict[str, list[float]] = {}
    relevant = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED))  # others are not read
    for name, value in samples(relevant):
        if (name in (RUNNING, WAITING) or name in KV_USAGE) and not math.isnan(value):
            found.setdefault(name, []).append(value)
    missing = [name for name in (RUNNING, WAITING) if name not in found]
    if missing:
        raise ScrapeError(f"no {' or '.join(missing)} in the page (not a vLLM engine?)")
    usage = next((found[name] for name in KV_USAGE if name in found), [0.0])
    kv = min(1.0, max(0.0, sum(usage) / len(usage)))
    return EngineLoad(running=round(sum(found[RUNNING])), waiting=round(sum(found[WAITING])), kv_usage=kv)


class Scraper:
    """Every `interval` seconds, scrapes every current target at once and hands each result to the sink."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        targets: Callable[[], Sequence[WorkerSpec]],
        sink: LoadSink,
        *,
        interval: float,
        timeout: float,
        on_error: ScrapeErrorHook | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.client = client
        self.targets = targets
        self.sink = sink
        self.interval = interval
        self.timeout = timeout
        self._on_error = on_error
        self._sleep = sleep
        self._failing: set[str] = set()  # worker ids whose last scrape failed (to log transitions only)

    async def run(self) -> None:
        """Scrapes forever. Cancel to stop."""
        while True:
            await self.scrape_once()
            await self._sleep(self.interval)

    async def scrape_once(self) -> None:
        specs = list(self.targets())
        results = await asyncio.gather(*(self._scrape(spec) for spec in specs))
        for spec, result in zip(specs, results, strict=True):
            if isinstance(result, PageFacts):
                self._ok(spec)
                self.sink.set_load(spec.id, result.load, result.ranks, result.block_size)
            else:
                self._failed(spec, result)
                self.sink.set_load(spec.id, None)
        self._failing &= {spec.id for spec in specs}

    async def _scrape(self, spec: WorkerSpec) -> PageFacts | str:
        """The worker's load, or why it could not be had."""
        try:
            async with asyncio.timeout(self.timeout):  # whole request; httpx's own timeouts are per phase
                response = await self.client.get(f"{spec.url}/metrics", timeout=self.timeout)
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            return parse_page(response.text)
        except TimeoutError:
            return f"no answer within {self.timeout:g} s"
        except (httpx.HTTPError, httpx.InvalidURL, ScrapeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug below us fails this worker's scrape, not the loop
            logger.warning("%s worker %s: /metrics scrape raised", spec.role, spec.id, exc_info=exc)
            return f"{type(exc).__name__}: {exc}"

    def _ok(self, spec: WorkerSpec) -> None:
        if spec.id in self._failing:
            self._failing.discard(spec.id)
            logger.info("%s worker %s: /metrics scraped again", spec.role, spec.id)

    def _failed(self, spec: WorkerSpec, reason: str) -> None:
        if spec.id not in self._failing:
            self._failing.add(spec.id)
            logger.warning("%s worker %s: /metrics scrape failed: %s", spec.role, spec.id, reason)
        if self._on_error is not None:
            self._on_error(spec, reason)
