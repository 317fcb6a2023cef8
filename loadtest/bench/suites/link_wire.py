"""Suite "link-wire": our connector against bare NIXL on the same shaped link, per preset (issue 21 item 3).

One P/D pair with our connector (KvpushConnector, product defaults: on the link's addresses `progress: auto`
runs its event-driven progress thread) behind a kvpush push router, and two more namespaces on the same link
for bare NIXL agents (stack/link/nixl_peer.py: a WRITE in 64 KiB descriptors with a notification, D on NIXL's
progress thread). Per preset: calibrate (P's prefill measured,
the rate set), then `repeats` prompts of `prompt_tokens` fresh token ids one at a time through the router
(our connector's own xfer-time histogram on P: one WRITE per prompt), then `repeats` bare WRITEs of the same
bytes, each after a `pause_s` pause (the bucket refills, so every transfer starts like a lone one). A row per
preset: both medians, their ratio, the target (within 10 % or 2 ms: linkrows.wire_verdict) and the bytes that
left P's NIC against the KV moved (the cma check).

    flock /tmp/kvpush-vllm.lock python -m loadtest.bench.suites.link_wire [--smoke]    # as root, ~4 min

appends the rows to bench/results/summary.json (suite `link-wire`); bench/README.md's link section shows the
latest run. Not in `kvpush bench`'s list: its rows have no load points to plot.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

import stack.link
from loadtest.bench import linkrows
from loadtest.bench.procs import router_proc, url, vllm_lock
from loadtest.bench.suites.link import xfer_counters
from loadtest.job import REPO
from loadtest.results import append_rows, git_commit
from stack.engines import Engine, Fleet, vllm_env
from stack.family import pd_family, start_family
from stack.link.calibrate import calibrate, prompt_ids
from stack.link.fabric import Link
from stack.link.plan import Place, nominal_prefill_s, preset, resolve
from stack.local import StackOptions, ensure_model
from stack.procs import free_port
from stack.tiny_model import SIZES

SUITE = "link-wire"
MODEL_SIZE = "bench"
PEER = Path(stack.link.__file__).with_name("nixl_peer.py")
PEER_PORT = 7100
OURS_METRIC = "vllm:kvpush_xfer_time_seconds"


@dataclass(frozen=True)
class WirePlan:
    presets: tuple[str, ...] = ("efa-like", "ethernet-100g-like", "ethernet-25g-like")
    prompt_tokens: int = 1024  # 8 blocks of 128: 64 descriptors of 64 KiB, 4 MiB
    repeats: int = 5
    pause_s: float = 0.3

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens + 128


FULL = WirePlan()
SMOKE = WirePlan(presets=("ethernet-100g-like",), prompt_tokens=256, repeats=2)


def _complete(base: str, ids: list[int], timeout_s: float = 120.0) -> None:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    httpx.post(base.rstrip("/") + "/v1/completions", json=body, timeout=timeout_s).raise_for_status()


def connector_times(router: str, p: Engine, plan: WirePlan, seed: int) -> list[float]:
    """Seconds of each of our connector's WRITEs, one prompt at a time (P's xfer-time histogram, per prompt)."""
    out = []
    engines = {"p": p.url}
    for i in range(plan.repeats):
        time.sleep(plan.pause_s)
        before = xfer_counters(engines)
        _complete(router, prompt_ids(plan.prompt_tokens, seed + i))
        got = linkrows.transfer_times(before, xfer_counters(engines))
        if got["xfer_count"] != 1 or got["xfer_source"] != f"p:{OURS_METRIC}":
            raise RuntimeError(f"link-wire: expected one WRITE of ours on P per prompt, got {got}")
        out.append(float(got["xfer_ms_mean"]) / 1000)
    return out


def bare_times(p: Place, d: Place, size: int, plan: WirePlan) -> list[float]:
    """Seconds of each bare NIXL WRITE of `size` bytes from `p` to `d` (the engines' link environment)."""
    peer = [sys.executable, str(PEER)]
    args = [d.address, str(PEER_PORT), str(size), str(plan.repeats)]
    env_p, env_d = (place.env(vllm_env(core=core, side_port=None)) for place, core in ((p, 0), (d, 1)))
    with subprocess.Popen(
        [*d.argv_prefix(), *peer, "target", *args], env=env_d, cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as target:
        try:
            done = subprocess.run(
                [*p.argv_prefix(), *peer, "initiator", *args, str(plan.pause_s)],
                env=env_p,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60 + 30 * plan.repeats,
            )
        finally:
            target.wait(timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"link-wire: bare NIXL initiator failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["arrived"] != result["sha"]:
        raise RuntimeError("link-wire: the bare WRITE's bytes did not all arrive")
    return [float(s) for s in result["seconds"]]


def run(plan: WirePlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    del progress  # one line per preset is all there is
    logs = run_dir / "logs"
    model = ensure_model(StackOptions(model_size=MODEL_SIZE))
    per_token = SIZES[MODEL_SIZE].kv_bytes_per_token()
    size = plan.prompt_tokens * per_token
    first = resolve(preset(plan.presets[0]), prefill_s=nominal_prefill_s(plan.prompt_tokens), kv_bytes=size)
    rows: list[dict[str, Any]] = []
    fam = pd_family(
        "lw-ours",
        model,
        "KvpushConnector",
        module="connector.plugin",
        extra_args=("--max-num-batched-tokens", str(plan.max_model_len)),  # one step, one WRITE per prompt
        max_model_len=plan.max_model_len,
    )
    with vllm_lock(), Link(first.shaping) as link, Fleet(logs) as fleet:
        pair = start_family(fleet, fam, timeout=600.0, link=link)
        p, d = pair.prefills[0], pair.decode
        port = free_port()
        proc = fleet.start(router_proc("router-lw", port, "push", p.engine_spec.prefill_arg(), d.url, logs))
        proc.wait_healthy(timeout=60.0)
        bare_p, bare_d = link.add("w-p"), link.add("w-d")
        _complete(url(port), prompt_ids(plan.prompt_tokens, 1))  # P-D handshake and UCX wire-up
        for k, name in enumerate(plan.presets):
            cal = calibrate(link, preset(name), p.url, prompt_tokens=plan.prompt_tokens, kv_bytes_per_token=per_token)
            meter = link.meter(p.engine_spec.name)
            ours = connector_times(url(port), p, plan, 5000 + 100 * k)
            check = meter.check(size * plan.repeats)
            bare = bare_times(bare_p, bare_d, size, plan)
            row = wire_row(plan, run_id, cal.record(), ours, bare, check.record())
            print(
                f"link-wire: {name}: ours {row['wire_connector_ms']} ms, bare NIXL {row['wire_bare_ms']} ms, "
                f"ratio {row['wire_ratio']}, ok {row['wire_ok']}, bytes ok {row['link_bytes_ok']}"
            )
            append_rows(summary, [row])
            rows.append(row)
    return rows


def wire_row(
    plan: WirePlan,
    run_id: str,
    link_record: dict[str, Any],
    ours: list[float],
    bare: list[float],
    checked: dict[str, Any],
) -> dict[str, Any]:
    """One preset's row: the link as calibrated, both sides' times (ms), the verdict and the bytes check."""
    return {
        "suite": SUITE,
        "run_id": run_id,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(REPO),
        "plan": asdict(plan),
        "input_len": plan.prompt_tokens,
        **link_record,
        **checked,
        "wire_connector_times_ms": [round(1000 * s, 3) for s in ours],
        "wire_bare_times_ms": [round(1000 * s, 3) for s in bare],
        **linkrows.wire_verdict(ours, bare),
    }


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    args.add_argument("--smoke", action="store_true", help="one preset, 256-token prompts, 2 repeats")
    args.add_argument("--summary", type=Path, default=REPO / "bench" / "results" / "summary.json")
    ns = args.parse_args(argv)
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + ("-smoke" if ns.smoke else "")
    run(SMOKE if ns.smoke else FULL, REPO / "bench" / "runs" / run_id, ns.summary, False, run_id)
    print(f"link-wire: run {run_id} -> {ns.summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
