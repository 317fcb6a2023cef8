"""Suite "overhead": what a front door adds, on zero-cost simulated workers (profile "zero").

Fronts on the same fake D: direct to D (baseline); kvpush push and vllm-router push on a P that answers like a
push prefill (`transfer_mode: push`, so vllm-router 0.1.17 learns the push identity and sends both legs at
once: every row records how the legs reached the workers, `wire_order`); kvpush pull and vllm-router pull on a
P that states pull. Closed loop at each concurrency, `repeats` times per point with the fronts' order rotated;
the front door's own CPU time and peak RSS are read from /proc for its process group.

`leg_clients` (e.g. `--set leg_clients=aiohttp,http1`) runs one kvpush push front per leg client side by side
(KVPUSH_LEG_CLIENT, router/config.py); every kvpush row records its client (`leg_client`), which is how rows of
several clients are told apart (the report shows a non-default client as its own front, `kvpush (aiohttp legs)`).

`cprofile=True` runs the kvpush push router under cProfile (its rows are marked `profiled` and left out of
the targets) and writes router-profile.json next to summary.json: where its time went, by category.
"""

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import benchkit as kit
from loadtest import profiling
from loadtest.job import REPO
from loadtest.results import RowLabels, git_commit
from router.config import LEG_CLIENTS, Settings
from stack.engines import Fleet
from stack.procs import ManagedProcess, free_port

PROFILE = "zero"


@dataclass(frozen=True)
class OverheadPlan:
    input_len: int
    output_len: int
    levels: tuple[tuple[int, int], ...]  # (concurrency, requests)
    repeats: int = 3
    cprofile: bool = False
    leg_clients: tuple[str, ...] = (Settings.leg_client,)  # kvpush push fronts, one per leg client


# 5 fronts x 3 repeats x (300 + 1500 + 3000 requests): about 5-7 minutes on 2 idle cores.
FULL = OverheadPlan(128, 16, ((1, 300), (64, 1500), (256, 3000)))
SMOKE = OverheadPlan(32, 4, ((1, 5), (4, 8)), repeats=1)


@dataclass(frozen=True)
class Front:
    router: str
    mode: str
    base: str
    proc: ManagedProcess | None
    p_url: str | None  # the simulated P behind it (for wire_order)
    leg_client: str | None = None  # kvpush only


@contextlib.contextmanager
def _leg_client(client: str) -> Iterator[None]:
    """The router started meanwhile uses `client` for its legs (KVPUSH_LEG_CLIENT, router/config.py)."""
    before = os.environ.get("KVPUSH_LEG_CLIENT")
    os.environ["KVPUSH_LEG_CLIENT"] = client
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVPUSH_LEG_CLIENT"]
        else:
            os.environ["KVPUSH_LEG_CLIENT"] = before


def _start(fleet: Fleet, proc: ManagedProcess) -> ManagedProcess:
    fleet.start(proc)
    proc.wait_healthy(timeout=60.0)
    return proc


def _fronts(fleet: Fleet, plan: OverheadPlan, logs: Path, prof_out: Path | None) -> tuple[list[Front], str]:
    d_port = free_port()
    fleet.start(kit.sim_proc("sim-zero-d", "decode", d_port, PROFILE, "both", logs))
    p_urls: dict[str, str] = {}
    for mode in ("push", "pull"):
        p_port = free_port()
        fleet.start(kit.sim_proc(f"sim-zero-p-{mode}", "prefill", p_port, PROFILE, mode, logs))
        p_urls[mode] = kit.url(p_port)
    fleet.wait_all_healthy(timeout=60.0)
    d_url = kit.url(d_port)
    fronts = [Front("direct", "direct", d_url, None, None)]
    unknown = set(plan.leg_clients) - set(LEG_CLIENTS)
    if unknown or not plan.leg_clients:
        raise ValueError(f"overhead: leg_clients must name some of {', '.join(LEG_CLIENTS)}, got {plan.leg_clients}")
    kvpush = [("push", c) for c in dict.fromkeys(plan.leg_clients)] + [("pull", Settings.leg_client)]
    for mode, client in kvpush:
        port = free_port()
        spec = f"{p_urls[mode]},engine_id=sim-zero-p-{mode},side_port={p_urls[mode].rsplit(':', 1)[1]}"
        default = client == Settings.leg_client
        out = prof_out if mode == "push" and default else None
        name = f"router-{mode}" + ("" if default else f"-{client}")
        with _leg_client(client):
            proc = _start(fleet, kit.router_proc(name, port, mode, spec, d_url, logs, cprofile_to=out))
        fronts.append(Front("kvpush", mode, kit.url(port), proc, p_urls[mode], client))
    binary = kit.vrouter_binary()
    if binary is None:
        hint = f"pip install vllm-router=={kit.VROUTER_VERSION} into .venv-vrouter"
        print(f"overhead: vllm-router not found ({hint}); its rows are skipped")
        return fronts, d_url
    for mode in ("push", "pull"):
        port, prom = free_port(), free_port()
        name = f"vllm-router-{mode}"
        proc = _start(fleet, kit.vrouter_proc(name, port, prom, p_urls[mode], d_url, logs, binary))
        fronts.append(Front("vllm-router", mode, kit.url(port), proc, p_urls[mode]))
    return fronts, d_url


def run(plan: OverheadPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    prof_out = run_dir / "router-push.prof" if plan.cprofile else None
    run_dir.mkdir(parents=True, exist_ok=True)
    with Fleet(logs) as fleet:
        fronts, d_url = _fronts(fleet, plan, logs, prof_out)
        profiled = [
            f.proc.pid
            for f in fronts
            if f.leg_client == Settings.leg_client and f.mode == "push" and f.proc and f.proc.pid and prof_out
        ]
        for pid in profiled:
            os.kill(pid, signal.SIGUSR1)  # start-up done: profile from here on
        k = len(fronts)
        for li, (conc, n) in enumerate(plan.levels):
            for rep in range(plan.repeats):
                for j in range(k):
                    front = fronts[(j + rep + li) % k]
                    rows.append(_point(front, plan, conc, n, rep, j, run_id, d_url, run_dir, summary, progress))
        for pid in profiled:
            os.kill(pid, signal.SIGUSR2)  # stop and write the profile
            _wait_for(prof_out)
    if prof_out is not None and prof_out.exists():
        done = plan.repeats * sum(n + min(2 * c, 200) for c, n in plan.levels)  # warm-up requests included
        data = profiling.breakdown(prof_out, requests=done)
        data["git_commit"], data["run_id"] = git_commit(REPO), run_id
        profiling.write(data, summary.parent / "router-profile.json")
        print(f"overhead: router profile of {done} requests -> {summary.parent / 'router-profile.json'}")
    return rows


def _wait_for(path: Path | None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path is not None and time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            time.sleep(0.5)  # let the writer finish
            return
        time.sleep(0.1)


def _point(
    front: Front,
    plan: OverheadPlan,
    conc: int,
    n: int,
    rep: int,
    order: int,
    run_id: str,
    d_url: str,
    run_dir: Path,
    summary: Path,
    progress: bool,
) -> dict[str, Any]:
    extra: dict[str, Any] = {"run_id": run_id, "profile": PROFILE, "repeat": rep, "order": order}
    if front.leg_client is not None:
        extra["leg_client"] = front.leg_client
    if plan.cprofile:
        extra["profiling_run"] = True  # the report keeps such runs out of the overhead tables
        if front.leg_client == Settings.leg_client and front.mode == "push":
            extra["profiled"] = True
    labels = RowLabels("overhead", front.router, front.mode, "sim", None, conc, plan.input_len, plan.output_len, extra)
    point = kit.Point(
        labels,
        front.base,
        n,
        seed=2000 + 10 * rep + order,
        warmup=min(2 * conc, 200),
        timeout_s=60.0,
        router_timings=front.leg_client is not None,
        legs_of=(front.p_url, d_url) if front.p_url else None,
    )
    return kit.measure(point, run_dir, summary, progress, cpu_pid=front.proc.pid if front.proc else None)
