"""The `loadtest` command line (`python -m loadtest`, hooked as `kvpush load`): run, sim, bench."""

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.arrivals import ArrivalSpec
from loadtest.bench.suites import SUITES
from loadtest.job import Job, execute
from loadtest.results import CONNECTORS, MODES, ROUTERS, RowLabels
from loadtest.runner import LoadConfig
from loadtest.sim.writes import WriteAt
from loadtest.stats import parse_goodput


def _add_run(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("run", help="send one load to an OpenAI-compatible endpoint and score it")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default="", help="default: the first id of GET /v1/models")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", "-n", type=int, default=100, help="always bounds the run")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--qps", type=float, default=math.inf, help="arrival rate (default: unlimited)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not scored")
    p.add_argument("--seed", type=int, default=0, help="arrival seed")
    p.add_argument("--salt", type=int, default=0, help="prompt seed (0 = from the clock: unique prompts)")
    p.add_argument("--tokenizer", choices=("synthetic", "server"), default="synthetic")
    p.add_argument("--tokenizer-url", default=None, help="server with /tokenize if --base-url has none")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--router-timings", action="store_true", help="join GET /debug/timings from --base-url")
    p.add_argument("--out-dir", type=Path, default=None, help="writes requests.jsonl and summary.json")
    p.add_argument("--summary", type=Path, default=None, help="append a row to this summary.json list")
    p.add_argument("--suite", choices=tuple(SUITES), default=None, help="row label (needed with --summary)")
    p.add_argument("--router", choices=ROUTERS, default="kvpush")
    p.add_argument("--mode", choices=MODES, default="push")
    p.add_argument("--connector", choices=CONNECTORS, default="sim")
    p.add_argument("--no-progress", action="store_true")


def _add_sim(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("sim", help="serve one simulated vLLM engine (prefill, decode or both)")
    p.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", default="zero", help="a name under loadtest/sim/profiles/ or a YAML path")
    p.add_argument("--engine-id", default="", help="default: sim-<role>-<port>")
    p.add_argument("--model", default="sim", help="served model name")
    p.add_argument(
        "--kv-mode",
        choices=("pull", "push", "both"),
        default="both",
        help="the connector a prefill sim states (transfer_mode); both = state none",
    )
    p.add_argument(
        "--write-at",
        choices=[w.value for w in WriteAt],
        default=WriteAt.COMPLETING_STEP.value,
        help="when a push P posts its WRITE: next-step (vLLM's NixlPushConnector), completing-step (kvpush push), "
        "per-step (kvpush progressive, chunked prefill)",
    )


def _add_bench(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("bench", help="run benchmark suites and write bench/results")
    p.add_argument("--suite", choices=(*SUITES, "all"), default="all")
    p.add_argument("--smoke", action="store_true", help="a tiny version of each suite (for make test)")
    p.add_argument("--results", type=Path, default=None, help="default: bench/results (smoke: bench/runs/smoke)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--profile", default=None, help="seed-sim only: a what-if simulator profile (name or YAML path)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a field of the suite's plan, e.g. repeats=3, qps=1,4,8, points=0.5:24,3:40 (repeatable)",
    )


def _add_calibrate(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("calibrate", help="fit the seed-sim profile's unmeasured numbers to the seed's pull row")
    p.add_argument("--results", type=Path, default=None, help="where calibration.json goes (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="a tiny fit (seconds), written under --results")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="loadtest", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    _add_sim(sub)
    _add_bench(sub)
    _add_calibrate(sub)
    return ap


def job_from_args(a: argparse.Namespace) -> Job:
    load = LoadConfig(
        base_url=a.base_url,
        model=a.model,
        input_len=a.input_len,
        output_len=a.output_len,
        num_requests=a.num_requests,
        arrivals=ArrivalSpec(a.qps, a.burstiness, a.seed),
        endpoint=a.endpoint,
        concurrency=a.concurrency,
        duration_s=a.duration,
        warmup=a.warmup,
        timeout_s=a.timeout,
    )
    labels = None
    if a.suite is not None:
        qps = None if math.isinf(a.qps) else a.qps
        labels = RowLabels(a.suite, a.router, a.mode, a.connector, qps, a.concurrency, a.input_len, a.output_len)
    return Job(
        load=load,
        tokenizer=a.tokenizer,
        tokenizer_url=a.tokenizer_url,
        salt=a.salt,
        slos_ms=parse_goodput(a.goodput),
        router_timings=a.router_timings,
        out_dir=a.out_dir,
        labels=labels,
        summary_path=a.summary,
        progress=None if a.no_progress else sys.stderr,
    )


def _print_summary(s: object) -> None:
    d = getattr(s, "__dict__", {})
    for key in ("n", "completed", "failed", "duration_s", "req_per_s", "output_tok_per_s", "goodput_req_per_s"):
        print(f"{key:>18}: {d.get(key)}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "handoff_ms"):
        dist = d.get(key)
        text = "-" if not dist else " ".join(f"{k} {v:9.2f}" for k, v in dist.items())
        print(f"{key:>18}: {text}")


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "run":
        if a.summary is not None and a.suite is None:
            print("--summary needs --suite (and --router/--mode/--connector) to label the row", file=sys.stderr)
            return 2
        _, summary = asyncio.run(execute(job_from_args(a)))
        _print_summary(summary)
        return 0 if summary.completed > 0 else 1
    if a.cmd == "sim":
        from loadtest.sim.server import serve

        engine_id = a.engine_id or f"sim-{a.role}-{a.port}"
        return serve(a.role, a.host, a.port, a.profile, engine_id, a.model, a.kv_mode, a.write_at)
    if a.cmd == "calibrate":
        return _calibrate(a)
    from loadtest.bench.run import run_suites

    return run_suites(
        a.suite,
        smoke=a.smoke,
        results=a.results,
        progress=not a.no_progress,
        profile=a.profile,
        overrides=a.overrides,
    )


def _calibrate(a: argparse.Namespace) -> int:
    from loadtest.job import REPO
    from loadtest.sim import calibrate
    from loadtest.sim.profile import PROFILE_DIR

    results = a.results or REPO / "bench" / "results"
    plan = calibrate.SMOKE_PLAN if a.smoke else calibrate.CalibrationPlan()
    data = calibrate.write_files(plan, results, profile_dir=results if a.smoke else PROFILE_DIR)
    push = data["predicted"]["upstream-push"]
    print(f"fitted {data['fitted']} (pull error {data['error']:.4f}, bounded: {data['bounded'] or 'none'})")
    print(f"pull: TTFT {data['pull']['ttft_mean_ms']:.0f} ms, TPOT {data['pull']['tpot_mean_ms']:.2f} ms")
    print(f"upstream-push predicted: TTFT {push['ttft_mean_ms']:.0f} ms, TPOT {push['tpot_mean_ms']:.2f} ms")
    return 0
