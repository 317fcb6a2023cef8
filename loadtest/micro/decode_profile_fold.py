"""Where a decode engine's time went: py-spy's raw samples and /proc's per-thread CPU folded into issue 41's parts.

Pure: no processes, no files. `loadtest.micro.decode_profile` records and calls `fold`.

py-spy's raw format (``--format raw --threads --full-filenames``, active samples only) is one line per distinct
stack: ``thread (TID): NAME;frame;frame;... COUNT``, root first, each frame ``func (path:line)``. The engine
core's main thread (vLLM's busy loop: scheduler, model runner, connector hooks, all on one thread when TP = 1)
is split by `main_part`; every other thread is counted whole (the connector's owner thread, vLLM's socket
threads, upstream's NIXL threads). Native threads py-spy does not see (OpenMP, UCX) are in `thread_cpu` only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The connector's code, ours and vLLM's (its NIXL connectors, the base class, the output aggregator, the model
# runner's connector glue). The outermost frame in one of these names the hook.
CONNECTOR_PATHS = ("/connector/", "vllm/distributed/kv_transfer/", "kv_connector_model_runner_mixin.py")
# the remaining parts of the main thread, first match from the root wins after the connector check
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("waiting on the other process (shm queue spin)", ("device_communicators/shm_broadcast.py",)),
    ("model forward", ("vllm/model_executor/", "torch/nn/modules/", "vllm/attention/", "vllm/v1/attention/")),
    ("sampling", ("vllm/v1/sample/",)),
    ("scheduler", ("vllm/v1/core/",)),
    ("model runner: inputs and outputs", ("vllm/v1/worker/", "vllm/v1/executor/")),
    ("engine core loop: outputs, IO", ("vllm/v1/engine/", "vllm/v1/serial_utils", "vllm/v1/outputs")),
)
MAIN = "MainThread"
_LINE = re.compile(r"^thread \((\d+)\): (.*) (\d+)$")
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


@dataclass(frozen=True)
class Stack:
    tid: int
    thread: str
    frames: tuple[tuple[str, str], ...]  # (function, path), root first
    count: int


def parse_raw(text: str) -> list[Stack]:
    """py-spy raw lines -> stacks (lines that are not samples are skipped)."""
    out: list[Stack] = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        name, *frames = m.group(2).split(";")
        parsed = []
        for frame in frames:
            f = _FRAME.match(frame)
            parsed.append((f.group(1), f.group(2)) if f else (frame, ""))
        out.append(Stack(int(m.group(1)), thread_label(name), tuple(parsed), int(m.group(3))))
    return out


def thread_label(name: str) -> str:
    """Python's default ``Thread-7 (process_input_sockets)`` -> ``process_input_sockets``; ThreadPoolExecutor's
    ``prefix_0`` -> ``prefix``; other names unchanged."""
    m = re.match(r"^Thread-\d+ \((.*)\)$", name)
    if m:
        return m.group(1)
    return re.sub(r"_\d+$", "", name)


def main_part(frames: Sequence[tuple[str, str]]) -> str:
    """The part of the engine's step a main-thread stack is in."""
    for func, path in frames:
        if any(p in path for p in CONNECTOR_PATHS):
            return f"connector: {func.rsplit('.', 1)[-1]}"
    for name, keys in PARTS:
        if any(k in path for _, path in frames for k in keys):
            return name
    return "other"


def parts(stacks: Iterable[Stack], process: str) -> dict[str, int]:
    """Samples per part of one process: the main thread's by `main_part`, every other thread whole (``thread:
    NAME``), each key prefixed with `process`."""
    out: dict[str, int] = {}
    for s in stacks:
        key = main_part(s.frames) if s.thread == MAIN else f"thread: {s.thread}"
        key = f"{process} {key}"
        out[key] = out.get(key, 0) + s.count
    return out


def thread_cpu(
    before: Mapping[int, float], after: Mapping[int, float], names: Mapping[int, str], comms: Mapping[int, str]
) -> dict[str, float]:
    """CPU seconds per thread name over a window, from /proc readings per tid (a thread that started within the
    window counts from 0). Python names from py-spy (`names`), else ``native: COMM``."""
    out: dict[str, float] = {}
    for tid, end in after.items():
        name = names.get(tid) or f"native: {comms.get(tid, '?')}"
        out[name] = out.get(name, 0.0) + end - before.get(tid, 0.0)
    return out


def fold(
    stacks: Mapping[str, Sequence[Stack]],
    rate_hz: float,
    steps: float,
    requests: int,
    cpu_by_thread: Mapping[str, float],
) -> dict[str, Any]:
    """One point's breakdown from each process's stacks (``{"core": ..., "worker": ...}``): busy ms per step by
    process and part (main threads by `main_part`, other threads whole), and CPU ms per request by thread (/proc,
    so native threads count too)."""
    samples: dict[str, int] = {}
    for process, some in stacks.items():
        samples |= parts(some, process)
    per_step = {k: 1000.0 * v / rate_hz / max(steps, 1.0) for k, v in sorted(samples.items(), key=lambda kv: -kv[1])}
    main_total = {
        p: sum(v for k, v in per_step.items() if k.startswith(f"{p} ") and " thread: " not in k) for p in stacks
    }
    n = max(requests, 1)
    return {
        "steps": steps,
        "requests": requests,
        "samples": sum(samples.values()),
        "main_busy_ms_per_step": main_total,
        "ms_per_step": per_step,
        "cpu_ms_per_request": {
            k: 1000.0 * v / n for k, v in sorted(cpu_by_thread.items(), key=lambda kv: -kv[1]) if v > 0
        },
        "cpu_ms_per_request_total": 1000.0 * sum(cpu_by_thread.values()) / n,
    }


def _median(xs: Sequence[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def _connector_ms(r: Mapping[str, Any], process: str) -> float:
    return float(sum(v for k, v in r["ms_per_step"].items() if k.startswith(f"{process} connector: ")))


def _threads_ms(r: Mapping[str, Any], names: tuple[str, ...]) -> float:
    """CPU ms per request of the worker's connector threads (ours: the owner and side-channel threads; upstream:
    its NIXL threads)."""
    return float(sum(v for k, v in r["cpu_ms_per_request"].items() if any(n in k for n in names)))


CONNECTOR_THREADS = ("kvpush", "nixl", "handshake")


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per pair and QPS, medians over repeats. TPOT, TTFT and CPU from the plain points (sampled ones
    where a run has none), the per-step split from the sampled ones."""
    head = (
        "| pair | QPS | TPOT ms | TTFT ms | decode CPU ms/req | connector threads CPU ms/req | worker: forward"
        " ms/step | worker: connector hooks ms/step | core: scheduler ms/step | core: connector hooks ms/step |"
        " steps |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    keys = sorted({(str(r["pair"]), float(r["qps"])) for r in results}, key=lambda k: (k[1], k[0]))
    for pair, qps in keys:
        mine = [r for r in results if r["pair"] == pair and r["qps"] == qps]
        plain = [r for r in mine if not r.get("sampled")] or mine
        sampled = [r for r in mine if r.get("sampled")] or mine

        def fmt(x: float | None, digits: int = 1) -> str:
            return "-" if x is None else f"{x:.{digits}f}"

        cells = [
            fmt(_median([r["tpot_ms_mean"] for r in plain if r.get("tpot_ms_mean") is not None]), 2),
            fmt(_median([r["ttft_ms_mean"] for r in plain if r.get("ttft_ms_mean") is not None]), 0),
            fmt(
                _median(
                    [r["decode_group_cpu_ms_per_request"] for r in plain if r.get("decode_group_cpu_ms_per_request")]
                )
            ),
            fmt(_median([_threads_ms(r, CONNECTOR_THREADS) for r in plain])),
            fmt(_median([r["ms_per_step"].get("worker model forward", 0.0) for r in sampled]), 2),
            fmt(_median([_connector_ms(r, "worker") for r in sampled]), 3),
            fmt(_median([r["ms_per_step"].get("core scheduler", 0.0) for r in sampled]), 3),
            fmt(_median([_connector_ms(r, "core") for r in sampled]), 3),
            fmt(_median([r["steps"] for r in plain]), 0),
        ]
        lines.append(f"| {pair} | {qps:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
