"""`python -m loadtest.faults.soak --duration 60m` (`make soak DURATION=60m`): mixed traffic through a live stack (two
prefill and one decode vLLM CPU engines on our push connector behind a router with default settings) at about
60 % of its measured capacity; samples every engine's and the router's RSS and open descriptors, the router's
requests in flight and every engine's KV usage once a minute; fails when any of them trends up after warm-up,
anything is held at the end, or a request ends in a way its kind does not allow. Writes bench/faults/soak.json."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from loadtest.faults.bed import REPO, BedShape, vllm_bed
from loadtest.faults.soak import judge as verdicts
from loadtest.faults.soak import sampler, traffic

OUT = REPO / "bench" / "faults" / "soak.json"
logger = logging.getLogger("kvpush.soak")


def seconds(text: str) -> float:
    """Pure: "90s", "45m", "1h" or a plain number of seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.faults.soak", description=__doc__)
    p.add_argument("--duration", type=seconds, default=seconds("60m"), help="traffic time: 90s, 45m, 1h")
    p.add_argument("--sample", type=seconds, default=60.0, help="sampling interval (default 60 s)")
    p.add_argument("--warmup", type=seconds, default=None, help="not judged (default min(10 m, duration / 6))")
    p.add_argument("--load", type=float, default=0.6, help="fraction of the measured capacity (default 0.6)")
    p.add_argument("--calibrate", type=seconds, default=60.0, help="closed-loop capacity probe length")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients of the capacity probe")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    warmup = a.warmup if a.warmup is not None else min(600.0, a.duration / 6)
    from loadtest.bench.procs import vllm_lock

    with vllm_lock(), vllm_bed({}, shape=BedShape("soak")) as bed, httpx.Client() as http:
        url = bed.router.url
        capacity = traffic.closed_loop(url, a.clients, a.calibrate, a.seed)
        rate = a.load * capacity
        logger.info(
            "capacity %.2f jobs/s with %d clients; soak at %.2f jobs/s for %g s", capacity, a.clients, rate, a.duration
        )
        tally, samples, shapes = traffic.Outcomes(), [], []
        t0 = time.monotonic()
        arrivals: list[int] = []
        load = threading.Thread(
            target=lambda: arrivals.append(traffic.open_loop(url, rate, t0 + a.duration, a.seed, tally)), daemon=True
        )
        load.start()
        while load.is_alive():
            samples.append(sampler.take(bed, time.monotonic() - t0, http))
            shapes.append(sampler.write_shape(bed.prefills, http))
            logger.info("sample %d: %s", len(samples), json.dumps(samples[-1].values))
            load.join(timeout=max(0.0, t0 + len(samples) * a.sample - time.monotonic()))
        router_left, engines_left = sampler.wait_quiet(bed, 90.0, http)
    kept = [s for s in samples if s.t >= warmup]
    names = sorted({k for s in samples for k in s.values})
    series = {n: (sampler.series_kind(n), [s.values.get(n, 0.0) for s in samples]) for n in names}
    verdict = verdicts.judge(
        series, len(samples) - len(kept), verdicts.Leftover(router_left, engines_left), tally.unexpected()
    )
    window = max(1, min(5, len(shapes) // 4))
    report = {
        "duration_s": a.duration,
        "warmup_s": warmup,
        "capacity_jobs_s": capacity,
        "rate_jobs_s": rate,
        "arrivals": arrivals[0] if arrivals else 0,
        "outcomes": tally.counts(),
        "unexpected": tally.unexpected(),
        "unexpected_details": tally.unexpected_details(),
        "trends": [{**asdict(t), "change": t.change} for t in verdict.trends],
        "left": verdict.left,
        "write_shape_start": sampler.shape_between(shapes[0], shapes[min(window, len(shapes) - 1)]) if shapes else {},
        "write_shape_end": sampler.shape_between(shapes[-1 - window], shapes[-1]) if len(shapes) > window else {},
        "samples": [asdict(s) for s in samples],
        "ok": verdict.ok,
        "reasons": verdict.reasons(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    print("soak " + ("passed" if verdict.ok else "FAILED: " + "; ".join(verdict.reasons())))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
