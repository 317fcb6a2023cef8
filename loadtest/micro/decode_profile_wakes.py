"""What decode's owner thread costs a running step while receives wait (issue 41 item 2):
``python -m loadtest.micro.decode_profile_wakes``.

Two ``TransferThread`` s on real NIXL DRAM agents in this process (UCX over loopback, the real TCP side channel,
as ``loadtest.micro.notices``), pinned to one core (``--core``, decode's). This thread plays decode's engine
loop: steps of a fixed amount of work, ``--python-frac`` of it pure Python (holding the GIL, as vLLM's scheduler
and runner do) and the rest numpy matmuls (GIL released, as torch's kernels), each followed by the step hook
(``kick`` + ``collect_results``). Decode registers receives as a `Shape` says (requests waiting for remote KV):
at 8 req/s with three always waiting (the prefill never finishes them; the oldest cancelled), or at 1.5 req/s
each finished by its prefill 150 ms later (the WRITE lands, decode takes the Done).

Per configuration, alternated over ``--rounds``: the step's wall time (median and mean, ms; what the running
requests see), the owner thread's wake-ups per second and CPU (ms per second, from its schedstat). Configurations:
``none-waiting`` (no receive: the floor), ``waiting`` (the owner thread as built), ``waiting-idle-tick`` (its
receive timer slowed to the 0.1 s idle tick: only the step's kicks wake it), ``arrivals-1.5``. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from connector.options import Options, Polling
from connector.orders import CancelOrder
from connector.transfer_thread import TransferThread
from connector.wire.metadata import PeerAddress
from connector.wire.plan import PrefillFinished, RegisterOrder
from loadtest.micro.notices import side


@dataclass(frozen=True)
class Shape:
    """A load on decode: a new registration every `every_s` (None: none), finished by its prefill `prefill_s`
    later (None: never; the oldest is cancelled beyond `waiting`), under `options`."""

    every_s: float | None
    prefill_s: float | None = None
    waiting: int = 3
    options: Options = field(default_factory=Options)


IDLE_TICK = Options(polling=Polling(write_poll_min_s=0.1, write_poll_max_s=0.1, idle_wait_s=0.1))
CONFIGS = {
    "none-waiting": Shape(None),
    "waiting": Shape(0.125),  # 8 req/s, 3 always waiting
    "waiting-idle-tick": Shape(0.125, options=IDLE_TICK),
    "arrivals-1.5": Shape(0.667, prefill_s=0.15, waiting=100),  # 1.5 req/s, each waits 150 ms for its prefill
}


def busy(n: int) -> int:
    """A fixed amount of pure-Python work (holds the GIL throughout)."""
    acc = 0
    for i in range(n):
        acc ^= i * 7
    return acc


MATRIX = 96  # one matmul of this size per `forward` iteration: ~0.1 ms, released GIL


def forward(a: np.ndarray, out: np.ndarray, n: int) -> None:
    """A fixed amount of numpy work that runs without the GIL (as torch's kernels do)."""
    for _ in range(n):
        np.matmul(a, a, out=out)


def owner_cpu_s(thread: TransferThread) -> float:
    tid = thread._thread.native_id
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def one(name: str, args: argparse.Namespace, work: tuple[int, int]) -> dict[str, float]:
    """One configuration for ``--seconds``: step times and the owner thread's wakes and CPU."""
    shape = CONFIGS[name]
    p, _ = side("P", shape.options, 64, 4096, seed=1)
    d, _ = side("D", shape.options, 64, 4096, seed=None)
    peer = PeerAddress("P", "127.0.0.1", p.side_port)
    live: deque[str] = deque()
    finishing: deque[tuple[float, int]] = deque()  # (when, n): the prefill of registration n finishes then
    n = 0
    a, out = np.full((MATRIX, MATRIX), 0.5), np.empty((MATRIX, MATRIX))

    def register(now: float) -> None:
        nonlocal n
        n += 1
        ids = tuple(range(n % 8 * 8, n % 8 * 8 + 8))
        d.submit(RegisterOrder(f"d{n}", f"t:{n}", peer, ids, 128))
        if shape.prefill_s is not None:
            finishing.append((now + shape.prefill_s, n))
            return
        live.append(f"d{n}")
        while len(live) > shape.waiting:
            d.submit(CancelOrder(live.popleft()))

    try:
        if shape.every_s is not None and shape.prefill_s is None:
            for _ in range(shape.waiting):
                register(time.perf_counter())
        time.sleep(0.5)  # handshake done, both threads settled
        steps: list[float] = []
        wakes0, cpu0, t0 = d.wakes, owner_cpu_s(d), time.perf_counter()
        next_register = t0
        while (now := time.perf_counter()) - t0 < args.seconds:
            if shape.every_s is not None and now >= next_register:
                register(now)
                next_register += shape.every_s
            while finishing and finishing[0][0] <= now:
                k = finishing.popleft()[1]
                p.submit(PrefillFinished(f"p{k}", f"t:{k}", tuple(range(8)), 128))
            start = time.perf_counter()
            busy(work[0])
            forward(a, out, work[1])
            d.kick()
            p.kick()
            d.collect_results()
            p.collect_results()
            steps.append(1e3 * (time.perf_counter() - start))
        span = time.perf_counter() - t0
        return {
            "step_ms_median": statistics.median(steps),
            "step_ms_mean": statistics.fmean(steps),
            "owner_wakes_per_s": (d.wakes - wakes0) / span,
            "owner_cpu_ms_per_s": 1e3 * (owner_cpu_s(d) - cpu0) / span,
        }
    finally:
        d.close()
        p.close()


def calibrate(step_ms: float, python_frac: float) -> tuple[int, int]:
    """Iterations of `busy` and of `forward` that take `python_frac` and the rest of `step_ms` here alone."""
    a, out = np.full((MATRIX, MATRIX), 0.5), np.empty((MATRIX, MATRIX))
    start = time.perf_counter()
    busy(100_000)
    per_busy = (time.perf_counter() - start) / 100_000
    start = time.perf_counter()
    forward(a, out, 200)
    per_forward = (time.perf_counter() - start) / 200
    ms = step_ms / 1e3
    return int(ms * python_frac / per_busy), int(ms * (1 - python_frac) / per_forward)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--step-ms", type=float, default=8.0, help="the work of one step, alone")
    ap.add_argument("--python-frac", type=float, default=0.3, help="of a step, holding the GIL (the rest: numpy)")
    ap.add_argument("--core", type=int, default=1, help="pin this process to this core (decode's), -1: not")
    ap.add_argument("--seconds", type=float, default=5.0, help="per configuration and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if a.core >= 0:
        os.sched_setaffinity(0, {a.core})
    work = calibrate(a.step_ms, a.python_frac)
    names = a.configs.split(",")
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rounds[name].append(one(name, a, work))
    out: dict[str, Any] = {"work_iterations": work, "args": vars(a)}
    for name, runs in rounds.items():
        out[name] = {k: round(statistics.median(x[k] for x in runs), 4) for k in runs[0]}
        out[name]["rounds"] = runs
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
