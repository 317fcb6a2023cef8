"""Where decode's time goes per push mode (issue 41): ``python -m loadtest.micro.decode_profile``.

Boots the cpu-vllm suite's pairs (pull: NixlConnector, upstream push: NixlPushConnector, ours: KvpushConnector;
every P on core 0, every D on core 1, our router in front of each) and, with ``--variant LABEL=JSON``, more pairs
of ours with that ``kv_connector_extra_config`` (an A/B of our options in the same run). Then per repeat, per QPS
point, per pair (the order reversed on odd repeats, so drift shows as spread) it loads the pair's router with the
suite's arrivals twice:

* sampled: py-spy (``record --nonblocking``: the engine is never paused; pinned to core 0, the prefills' core)
  on the decode's engine-core process and its model worker, during the load only;
* plain: the same point without py-spy (``--no-plain`` skips it), for TPOT and CPU unperturbed.

Both read /proc: CPU per thread of both processes (schedstat) and the decode's process group CPU per request.
Decode steps are counted from ``vllm:iteration_tokens_total``. Folded by `loadtest.micro.decode_profile_fold`:
busy ms per decode step by process and part (model forward, sampling, scheduler, runner, each connector hook by
name; other threads whole: our owner thread ``kvpush-transfer``, upstream's NIXL threads) and CPU ms per request
by thread.

Needs py-spy (a dev dependency: ``make venv`` installs it; ptrace allowed). Run under the machine's lock:
``flock /tmp/kvpush-vllm.lock timeout 1200 .venv/bin/python -m loadtest.micro.decode_profile --qps 1.5,8``.
Writes ``decode_profile.json`` (one object per point) and the points' rows (summary.json) under ``--out`` and
prints a Markdown table of it (``--table FILE`` prints that of an earlier run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import promtext
from loadtest.bench.fronts import Front
from loadtest.bench.point import measure, scrape
from loadtest.bench.procs import vllm_lock
from loadtest.bench.suites.cpu import FAMILIES, MODEL_SIZE, Family, engine_point, front_labels, start_fronts
from loadtest.job import REPO
from loadtest.micro.decode_profile_fold import fold, parse_raw, table, thread_cpu
from stack.engines import Engine, Fleet
from stack.family import pd_family, start_family
from stack.local import StackOptions, ensure_model
from stack.procs import group_members

STEPS = "vllm:iteration_tokens_total_count"


@dataclass(frozen=True)
class ProfiledPair:
    """One P/D pair to profile: the rows' `connector` label, its router mode, vLLM connector and extra config."""

    label: str
    mode: str
    connector: str
    module: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def pairs_for(names: Sequence[str], variants: Sequence[str]) -> list[ProfiledPair]:
    """The cpu-vllm families named, then one of ours per ``LABEL=JSON`` variant (label ``kvpush-push-LABEL``)."""
    known = {f.label: f for f in FAMILIES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown pairs {unknown} (known: {sorted(known)})")
    out = [ProfiledPair(f.label, f.mode, f.connector, f.module) for f in (known[n] for n in names)]
    for item in variants:
        label, sep, text = item.partition("=")
        if not sep or not label:
            raise ValueError(f"--variant {item!r}: expected LABEL=JSON")
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise ValueError(f"--variant {item!r}: the JSON must be an object")
        out.append(ProfiledPair(f"kvpush-push-{label}", "push", "KvpushConnector", "connector.plugin", extra))
    return out


def decode_processes(api_pid: int) -> dict[str, int]:
    """The decode's engine-core process (vLLM titles it ``VLLM::EngineCore``) and its model worker
    (``VLLM::Worker...``, where the model and the connector's worker half run), as found."""
    out: dict[str, int] = {}
    for pid in group_members(api_pid):
        try:
            title = Path(f"/proc/{pid}/comm").read_text() + Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if "EngineCore" in title:
            out.setdefault("core", pid)
        elif "Worker" in title:
            out.setdefault("worker", pid)
    if not out:
        raise RuntimeError(f"no engine-core or worker process under {api_pid}")
    return out


def threads_cpu_s(pid: int) -> tuple[dict[int, float], dict[int, str]]:
    """CPU seconds (schedstat) and comm per live thread of `pid`."""
    cpu: dict[int, float] = {}
    comm: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            comm[int(tid)] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
    return cpu, comm


class Sampler:
    """py-spy recording one process until stopped (SIGINT makes it write its file)."""

    def __init__(self, pyspy: str, pid: int, rate_hz: int, out: Path, core: int) -> None:
        self.out = out
        argv = [pyspy, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format", "raw", "--threads"]
        argv += ["--full-filenames", "--nonblocking", "-o", str(out)]
        pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
        self._proc = subprocess.Popen([*pin, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> str:
        self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=30.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate(timeout=10.0)
        if not self.out.exists():  # the point's figures still count; its split is empty
            print(f"decode_profile: py-spy wrote nothing: {err[-500:]}", file=sys.stderr)
            return ""
        return self.out.read_text(encoding="utf-8")


def profile_point(
    label: str,
    front: Front,
    d: Engine,
    args: argparse.Namespace,
    at: tuple[float, int, int],
    run_dir: Path,
    names: dict[int, str],
    sampled: bool,
) -> dict[str, Any]:
    """One loaded point (`at`: QPS, its index, the repeat) of one pair, with py-spy attached when `sampled`: its
    row's figures and the fold. `names` (tid -> Python thread name) is learned from sampled points and names the
    threads' CPU of plain ones."""
    assert d.pid is not None
    qps, index, rep = at
    procs = decode_processes(d.pid)
    labels = front_labels("decode-profile", front, qps, args.input_len, args.output_len)
    extra = {"repeat": rep, "run_id": run_dir.name, "sampled": sampled, "pair": label}
    point = engine_point(front, labels, max(10, math.ceil(qps * args.point_s)), 3000 + index, 2, extra)
    steps0 = promtext.total(scrape(d.url), STEPS)
    cpu0 = {name: threads_cpu_s(pid)[0] for name, pid in procs.items()}
    tag = f"{label}-q{qps}-r{rep}"
    samplers = {
        name: Sampler(args.pyspy, pid, args.rate, run_dir / f"{tag}-{name}.raw", 0)
        for name, pid in procs.items()
        if sampled
    }
    time.sleep(0.3)  # attached before the load starts
    try:
        row = measure(point, run_dir, run_dir / "summary.json", False, cpu_pid=d.pid)
    finally:
        raws = {name: sampler.stop() for name, sampler in samplers.items()}
    steps = promtext.total(scrape(d.url), STEPS) - steps0
    stacks = {name: parse_raw(raw) for name, raw in raws.items()}
    names |= {s.tid: s.thread for some in stacks.values() for s in some}
    cpu: dict[str, float] = {}
    for name, pid in procs.items():
        after, comms = threads_cpu_s(pid)
        cpu |= {f"{name} {k}": v for k, v in thread_cpu(cpu0[name], after, names, comms).items()}
    out = fold(stacks, float(args.rate), steps, int(row["n"]) + 2, cpu)
    out |= {
        "pair": label,
        "qps": qps,
        "repeat": rep,
        "sampled": sampled,
        "tpot_ms_mean": (row.get("tpot_ms") or {}).get("mean"),
        "ttft_ms_mean": (row.get("ttft_ms") or {}).get("mean"),
        "failed": row["failed"],
        "req_per_s": row["req_per_s"],
        "decode_group_cpu_ms_per_request": row.get("cpu_s_per_1k"),
        "kv_external_frac": row.get("kv_external_frac"),
    }
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    run_dir = Path(args.out) / dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(StackOptions(model_size=MODEL_SIZE))
    pairs = pairs_for(args.pairs.split(","), args.variant)
    results: list[dict[str, Any]] = []
    with vllm_lock(), Fleet(run_dir / "logs") as fleet:
        beds: list[tuple[str, Front, Engine]] = []
        for pair in pairs:  # one pair at a time (ports: see the cpu-vllm suite)
            family = pd_family(
                f"vllm-{pair.label}", model, pair.connector, module=pair.module, connector_extra=pair.extra
            )
            engines = start_family(fleet, family, timeout=600.0)
            p, d = engines.prefills[0], engines.decode
            base = "kvpush-push" if pair.extra else pair.label  # a row's connector is one the report knows
            fam = Family(base, pair.mode, pair.connector, pair.module)
            beds.append((pair.label, start_fronts(fleet, fam, p, d, run_dir / "logs", vrouter=False)[0], d))
        names: dict[int, str] = {}
        for rep in range(args.repeats):
            for i, qps in enumerate(args.qps):
                for label, front, d in beds if rep % 2 == 0 else beds[::-1]:
                    for sampled in (True, False) if args.plain else (True,):
                        result = profile_point(label, front, d, args, (qps, i, rep), run_dir, names, sampled)
                        results.append(result)
                        print(summary_line(result), flush=True)
                        (run_dir / "decode_profile.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"decode_profile: {run_dir / 'decode_profile.json'}")
    return results


def summary_line(r: Mapping[str, Any]) -> str:
    top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["ms_per_step"].items())[:8])
    return (
        f"{r['pair']} q{r['qps']} r{r['repeat']} {'sampled' if r['sampled'] else 'plain'}:"
        f" TPOT {r['tpot_ms_mean']} TTFT {r['ttft_ms_mean']} steps "
        f"{r['steps']:.0f} main busy ms/step {r['main_busy_ms_per_step']} [{top}] decode CPU/req "
        f"{r['cpu_ms_per_request_total']:.1f} ms (group {r['decode_group_cpu_ms_per_request']})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qps", type=lambda s: tuple(float(x) for x in s.split(",")), default=(1.5, 8.0))
    ap.add_argument("--point-s", type=float, default=20.0, help="requests per point: qps x this (at least 10)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pairs", default=",".join(f.label for f in FAMILIES))
    ap.add_argument("--variant", action="append", default=[], help="LABEL=JSON: one more pair of ours")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each sampled point, the same point without py-spy (TPOT and CPU unperturbed)",
    )
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pyspy", default=str(Path(sys.executable).parent / "py-spy"))
    ap.add_argument("--out", default=str(REPO / "bench" / "runs" / "decode-profile"))
    ap.add_argument("--table", help="only print the Markdown table of this decode_profile.json")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text(encoding="utf-8"))), end="")
        return 0
    print(table(run(args)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
