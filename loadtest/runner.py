"""One load run: warm-up, then requests sent on an arrival schedule under an optional concurrency cap."""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.client import ENDPOINTS, RequestSpec, payload, send
from loadtest.progress import Progress
from loadtest.prompts import Prompt
from loadtest.records import ClientRecord

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class LoadConfig:
    """What to send and how fast. `num_requests` always bounds the run; `duration_s` may cut it earlier."""

    base_url: str
    model: str
    input_len: int
    output_len: int
    num_requests: int
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    endpoint: str = "completions"
    concurrency: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    timeout_s: float = 120.0
    request_id_prefix: str = "lt"
    check_output_len: bool = True

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclass
class RunResult:
    records: list[ClientRecord]
    duration_s: float
    warmup: list[ClientRecord]
    started_unix: float = 0.0  # wall clock when the load began (set by job; tells loads run together apart)


def make_client(cfg: LoadConfig) -> httpx.AsyncClient:
    """One pooled client sized for the run; every call still carries its own deadline."""
    conns = max(cfg.concurrency or 0, 64, min(cfg.num_requests, 4096))
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s, connect=10.0))


async def _one(
    cfg: LoadConfig, client: httpx.AsyncClient, prompt: Prompt, rec: ClientRecord, clock: Clock
) -> ClientRecord:
    body = payload(RequestSpec(cfg.endpoint, cfg.model, prompt.text, cfg.output_len))
    expect = cfg.output_len if cfg.check_output_len else None
    return await send(client, cfg.url, body, rec, clock, cfg.timeout_s, expect)


async def warm_up(
    cfg: LoadConfig, client: httpx.AsyncClient, prompts: Sequence[Prompt], clock: Clock
) -> list[ClientRecord]:
    """Warm-up requests, at most `concurrency` at a time; their results are returned apart and never scored."""
    sem = asyncio.Semaphore(cfg.concurrency or max(len(prompts), 1))

    async def go(i: int, p: Prompt) -> ClientRecord:
        async with sem:
            rec = ClientRecord(index=-1 - i, request_id=f"{cfg.request_id_prefix}-warm-{i}")
            return await _one(cfg, client, p, rec, clock)

    return list(await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts))))


async def run_load(
    cfg: LoadConfig,
    client: httpx.AsyncClient,
    prompts: Sequence[Prompt],
    progress: Progress | None = None,
    clock: Clock = time.perf_counter,
    sleep: Sleep = asyncio.sleep,
) -> RunResult:
    """Send `prompts[warmup:]` on the schedule; failures are recorded, never dropped."""
    warm = await warm_up(cfg, client, prompts[: cfg.warmup], clock) if cfg.warmup else []
    main = prompts[cfg.warmup :]
    times = schedule(cfg.arrivals, len(main), cfg.duration_s)
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    start = clock()

    async def go(i: int, rec: ClientRecord) -> ClientRecord:
        try:
            return await _one(cfg, client, main[i], rec, clock)
        finally:
            if sem is not None:
                sem.release()
            if progress is not None:
                progress.update(rec.ok)

    tasks: list[asyncio.Task[ClientRecord]] = []
    for i, offset in enumerate(times):
        delay = start + offset - clock()
        if delay > 0:
            await sleep(delay)
        if sem is not None:
            await sem.acquire()
        if cfg.duration_s is not None and clock() - start >= cfg.duration_s:
            if sem is not None:
                sem.release()
            break
        rec = ClientRecord(index=i, request_id=f"{cfg.request_id_prefix}-{i}", sent=clock() - start)
        tasks.append(asyncio.create_task(go(i, rec)))
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
    if progress is not None:
        progress.close()
    return RunResult(records=records, duration_s=clock() - start, warmup=warm)
