"""A complete measured run: resolve the model, build prompts, send the load, join router timings, write files."""

import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

import httpx

from loadtest import timings
from loadtest.progress import Progress
from loadtest.prompts import HttpTokenizer, Prompt, Tokenizer, WordTokenizer, build_prompt
from loadtest.records import write_jsonl
from loadtest.results import RowLabels, append_rows, build_row, clean, git_commit
from loadtest.runner import LoadConfig, RunResult, make_client, run_load, warm_up
from loadtest.stats import Summary, summarize

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Job:
    load: LoadConfig
    tokenizer: str = "synthetic"  # "synthetic" (word count) | "server" (the target's /tokenize)
    tokenizer_url: str | None = None  # where /tokenize lives when the target (a router) has none
    salt: int = 0  # makes every run's prompts unique; 0 = derive from the clock
    slos_ms: dict[str, float] = field(default_factory=dict)
    router_timings: bool = False
    out_dir: Path | None = None
    labels: RowLabels | None = None
    summary_path: Path | None = None
    progress: TextIO | None = sys.stderr
    label: str = ""
    on_loaded: Callable[[], None] | None = None  # called when the load is done, before the router timings are read


async def resolve_model(client: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def make_prompts(job: Job, client: httpx.AsyncClient, model: str) -> list[Prompt]:
    cfg = job.load
    salt = job.salt or int(time.time() * 1000) % 1_000_000_007
    rng = random.Random(salt)
    tok: Tokenizer = WordTokenizer()
    if job.tokenizer == "server":
        tok = HttpTokenizer(client, job.tokenizer_url or cfg.base_url, model)
    total = cfg.warmup + cfg.num_requests
    return [await build_prompt(tok, cfg.input_len, salt, i, rng) for i in range(total)]


async def _resolved(cfg: LoadConfig, client: httpx.AsyncClient) -> LoadConfig:
    """The load with its model named (the target's first model when the load names none)."""
    model = cfg.model or await resolve_model(client, cfg.base_url)
    return cfg if model == cfg.model else replace(cfg, model=model)


async def _send(job: Job, cfg: LoadConfig, client: httpx.AsyncClient, prompts: list[Prompt]) -> RunResult:
    progress = Progress(len(prompts) - cfg.warmup, job.progress, time.perf_counter, job.label)
    started = time.time()
    result = await run_load(cfg, client, prompts, progress)
    result.started_unix = started
    if job.on_loaded is not None:
        job.on_loaded()
    if job.router_timings:
        found = await timings.fetch(client, cfg.base_url, [r.request_id for r in result.records])
        timings.join(result.records, found)
    return result


def _finish(job: Job, result: RunResult) -> tuple[RunResult, Summary]:
    summary = summarize(result.records, result.duration_s, job.slos_ms)
    write_outputs(job, result, summary)
    return result, summary


async def execute(job: Job) -> tuple[RunResult, Summary]:
    async with make_client(job.load) as client:
        cfg = await _resolved(job.load, client)
        prompts = await make_prompts(job, client, cfg.model)
        result = await _send(job, cfg, client, prompts)
    return _finish(job, result)


async def execute_together(jobs: Sequence[Job]) -> list[tuple[RunResult, Summary]]:
    """Jobs whose loads run at the same time (fronts side by side on one pair): every job's prompts are built
    and its warm-up sent first, then all loads start together, so their arrival schedules line up. Give the
    jobs distinct salts, or they send the same prompts."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(make_client(j.load)) for j in jobs]
        cfgs = [await _resolved(j.load, c) for j, c in zip(jobs, clients, strict=True)]
        prompts = [await make_prompts(j, c, cfg.model) for j, c, cfg in zip(jobs, clients, cfgs, strict=True)]
        warm = await asyncio.gather(
            *(
                warm_up(cfg, c, p[: cfg.warmup], time.perf_counter)
                for cfg, c, p in zip(cfgs, clients, prompts, strict=True)
            )
        )
        results = await asyncio.gather(
            *(
                _send(j, replace(cfg, warmup=0), c, p[cfg.warmup :])
                for j, cfg, c, p in zip(jobs, cfgs, clients, prompts, strict=True)
            )
        )
    for result, sent in zip(results, warm, strict=True):
        result.warmup = sent
    return [_finish(j, r) for j, r in zip(jobs, results, strict=True)]


def write_outputs(job: Job, result: RunResult, summary: Summary) -> None:
    row = build_row(summary, job.labels, git_commit(REPO)) if job.labels else None
    if job.out_dir is not None:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(job.out_dir / "requests.jsonl", result.records)
        doc = row if row is not None else {k: clean(v) for k, v in summary.__dict__.items()}
        (job.out_dir / "summary.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if row is not None and job.summary_path is not None:
        append_rows(job.summary_path, [row])
