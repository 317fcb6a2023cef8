"""How many KV events a router's subscriber consumes without falling behind (issue 24): a one-off measurement
behind the multiturn replicas run's events/s figures, no engine needed.

A publisher process sends vLLM-shaped messages on a ZMQ PUB socket at a paced rate (each one batch, the
array-batch/map-events layout vLLM 0.32-0.34 use: a BlockStored of `blocks` chained blocks of 16 tokens and a
BlockRemoved of as many older ones, as a busy engine's step stores and evicts), numbered 0, 1, 2, ... as vLLM
does; this process runs the router's own `KvEventSubscriber` on an asyncio loop and, after the publisher is done
and the socket drained, reads its counters: messages and events consumed, seq gaps (a subscriber that falls behind
overflows ZMQ's queues: the lost messages show as gaps), each batch's lag from its stamp, and this process's CPU
seconds per 1000 messages. One line of JSON per rate, and all of them in bench/results/kv-events-rate.json
(bench/README.md's multi-turn replicas part shows them).

    .venv/bin/python -m loadtest.micro.kv_events_rate --rates 500,2000,5000,10000 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import resource
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from loadtest.job import REPO
from loadtest.results import git_commit
from router.kv_events.endpoints import RankPublisher
from router.kv_events.index import KvIndex
from router.kv_events.subscriber import KvEventSubscriber
from stack.procs import free_port

BLOCK = 16


def _batch(seq: int, blocks: int) -> bytes:
    first = seq * blocks
    stored = {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + blocks)),
        "parent_block_hash": first - 1 if first else None,
        "token_ids": [(first + i) % 2000 for i in range(blocks * BLOCK)],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }
    removed = {"type": "BlockRemoved", "block_hashes": list(range(first - blocks, first)), "medium": "GPU"}
    events = [stored, removed] if first else [stored]
    return msgspec.msgpack.encode([time.time(), events, 0])


def publish(port: int, rate: float, seconds: float, blocks: int, ready_s: float) -> None:
    """The publisher process: bind, let the subscriber join, then send `rate` messages per second."""
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    time.sleep(ready_s)
    total = int(rate * seconds)
    t0 = time.monotonic()
    for seq in range(total):
        due = t0 + seq / rate
        wait = due - time.monotonic()
        if wait > 0.0005:
            time.sleep(wait)
        sock.send_multipart([b"", seq.to_bytes(8, "big"), _batch(seq, blocks)])
    sock.close()
    context.term()


async def _consume(port: int, rate: float, seconds: float, blocks: int) -> dict[str, Any]:
    subscriber = KvEventSubscriber(KvIndex(200_000))
    subscriber.add([RankPublisher("w", 0, f"tcp://127.0.0.1:{port}", None, "")])
    task = asyncio.create_task(subscriber.run())
    spawn = multiprocessing.get_context("spawn")
    publisher = spawn.Process(target=publish, args=(port, rate, seconds, blocks, 1.5))
    cpu0 = _cpu()
    publisher.start()
    await asyncio.to_thread(publisher.join, seconds + 60)
    sent = int(rate * seconds)
    for _ in range(600):  # the rest drains (a bound of 30 s)
        if subscriber.frames.messages + subscriber.sequence.gaps >= sent:
            break
        await asyncio.sleep(0.05)
    cpu = _cpu() - cpu0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    subscriber.close()
    frames, seq = subscriber.frames, subscriber.sequence
    return {
        "rate_asked": rate,
        "seconds": seconds,
        "blocks_per_message": blocks,
        "sent": sent,
        "consumed": frames.messages,
        "events_consumed": frames.events,
        "events_per_s": round(frames.events / seconds, 1),
        "blocks_per_s": round(frames.messages * blocks / seconds, 1),
        "gaps": seq.gaps,
        "holes": seq.holes,
        "lag_ms_mean": round(frames.lag_us_total / frames.timed / 1000, 3) if frames.timed else None,
        "lag_ms_max": round(frames.lag_us_max / 1000, 3),
        "late_over_1s": frames.late,
        "malformed": frames.malformed + frames.oversized,
        "replays": seq.replays,
        "disconnects": frames.disconnects,  # the publisher exiting at the end: one, and the hole it leaves
        "index_bound_evictions": subscriber.index.counters.capacity,
        "cpu_ms_per_1k_messages": round(cpu / max(1, frames.messages) * 1e6, 2),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,5000,20000", help="messages per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--blocks", type=int, default=8, help="blocks stored (and as many evicted) per message")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv-events-rate.json")
    args = parser.parse_args()
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        rows.append(asyncio.run(_consume(free_port(), rate, args.seconds, args.blocks)))
        print(json.dumps(rows[-1]), flush=True)
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    record = {"run_id": run_id, "git_commit": git_commit(REPO), "loadavg": os.getloadavg()[0], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"-> {args.out} (run {run_id})")


if __name__ == "__main__":
    main()
