"""A complete measured run: resolve the model, build prompts, send the load, join router timings, write files."""

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from loadtest import timings
from loadtest.progress import Progress
from loadtest.prompts import HttpTokenizer, Prompt, Tokenizer, WordTokenizer, build_prompt
from loadtest.records import write_jsonl
from loadtest.results import RowLabels, append_rows, build_row, clean, git_commit
from loadtest.runner import LoadConfig, RunResult, make_client, run_load
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


async def execute(job: Job) -> tuple[RunResult, Summary]:
    cfg = job.load
    async with make_client(cfg) as client:
        model = cfg.model or await resolve_model(client, cfg.base_url)
        if model != cfg.model:
            cfg = LoadConfig(**{**cfg.__dict__, "model": model})
        prompts = await make_prompts(job, client, model)
        n = len(prompts) - cfg.warmup
        progress = Progress(n, job.progress, time.perf_counter, job.label)
        result = await run_load(cfg, client, prompts, progress)
        if job.router_timings:
            found = await timings.fetch(client, cfg.base_url, [r.request_id for r in result.records])
            timings.join(result.records, found)
    summary = summarize(result.records, result.duration_s, job.slos_ms)
    write_outputs(job, result, summary)
    return result, summary


def write_outputs(job: Job, result: RunResult, summary: Summary) -> None:
    row = build_row(summary, job.labels, git_commit(REPO)) if job.labels else None
    if job.out_dir is not None:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(job.out_dir / "requests.jsonl", result.records)
        doc = row if row is not None else {k: clean(v) for k, v in summary.__dict__.items()}
        (job.out_dir / "summary.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if row is not None and job.summary_path is not None:
        append_rows(job.summary_path, [row])
