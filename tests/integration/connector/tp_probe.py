"""A by-hand probe (not a test) of a TP pair on real vLLM CPU with our connector, for connector/README.md's figures.

    flock /tmp/kvpush-vllm.lock timeout 300 .venv/bin/python -m tests.integration.connector.tp_probe P_TP D_TP

Starts the pair as `test_vllm_tp.py` does (prefill on core 0, decode on core 1, every rank of an engine on its
core), sends two requests through the router, then the legs by hand with the decode leg HOLD_S (8) seconds late:
P answers its leg and holds the finished blocks until decode registers. Every 2 s it samples each engine
process's CPU (psutil); it prints each request's status, time and decode's prompt sources, and the mean CPU per
process over the whole run and over the hold.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from typing import Any

import httpx
import psutil  # type: ignore[import-untyped]  # no stubs in the venv; a by-hand probe

from stack.engines import Engine, Fleet
from stack.family import pd_family, start_family
from tests.integration.support import LOGS, tiny_model
from tests.integration.vllm_support import kv_sources, prompt_text, router

HOLD_S = float(os.environ.get("HOLD_S", "8"))
Sample = dict[str, float]


class CpuSampler(threading.Thread):
    """CPU % of every process under each root, every 2 s, until `stop`."""

    def __init__(self, roots: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.samples, self.done = roots, list[tuple[float, Sample]](), threading.Event()
        self._procs: dict[str, psutil.Process] = {}

    def run(self) -> None:
        while not self.done.is_set():
            for name, pid in self.roots.items():
                try:
                    root = psutil.Process(pid)
                    for proc in [root, *root.children(recursive=True)]:
                        key = f"{name}/{proc.pid}:{proc.name()[:18]}"
                        if key not in self._procs:
                            self._procs[key] = proc
                            proc.cpu_percent(None)
                except psutil.Error:
                    continue
            self.done.wait(2.0)
            row: Sample = {}
            for key, proc in self._procs.items():
                try:
                    row[key] = proc.cpu_percent(None)
                except psutil.Error:
                    continue
            self.samples.append((time.monotonic(), row))

    def means(self, since: float = 0.0, until: float = float("inf")) -> dict[str, float]:
        rows = [row for t, row in self.samples if since + 2.0 <= t <= until + 0.5]
        keys = sorted({k for row in rows for k in row})
        return {k: round(sum(r.get(k, 0.0) for r in rows) / len(rows), 1) for k in keys} if rows else {}


def late_decode(p: Engine, d: Engine, p_tp: int) -> tuple[float, float]:
    """P's leg, then decode's HOLD_S later; prints both; returns the hold window (monotonic)."""
    rid, tid = f"kvp-{uuid.uuid4().hex}", f"xfer-{uuid.uuid4().hex}"
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt_text(20), "max_tokens": 8, "temperature": 0}
    leg = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    r = httpx.post(f"{p.url}/v1/completions", json=leg, headers={"X-Request-Id": rid}, timeout=60)
    print(f"held: P leg {r.status_code}", flush=True)
    since = time.monotonic()
    time.sleep(HOLD_S)
    until, before = time.monotonic(), kv_sources(d.url)
    spec = p.engine_spec
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": spec.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": spec.side_port,
        "tp_size": p_tp,
        "pp_size": 1,
        "remote_request_id": rid,
        "transfer_id": tid,
    }
    t = time.monotonic()
    r = httpx.post(
        f"{d.url}/v1/completions",
        json=dict(body, kv_transfer_params=params),
        headers={"X-Request-Id": rid},
        timeout=120,
    )
    seconds = time.monotonic() - t
    time.sleep(1.0)  # the decode's metrics catch up
    moved = kv_sources(d.url)["external_kv_transfer"] - before["external_kv_transfer"]
    print(f"held: D leg {HOLD_S:.0f} s late: {r.status_code} in {seconds:.2f} s, external_kv_transfer +{moved}")
    return since, until


def main(p_tp: int, d_tp: int) -> None:
    def tp(n: int) -> tuple[str, ...]:
        return ("--tensor-parallel-size", str(n)) if n > 1 else ()

    family = pd_family(
        "tprobe",
        tiny_model(),
        "KvpushConnector",
        module="connector.plugin",
        engine_suffix=f"-{uuid.uuid4().hex[:6]}",
        prefill_args=(tp(p_tp),),
        decode_args=tp(d_tp),
        connector_extra={"kv_timeout_s": 60.0},
    )
    t = time.monotonic()
    with Fleet(LOGS, spread_start=True) as fleet:
        pd = start_family(fleet, family, 400)
        print(f"started in {time.monotonic() - t:.1f} s", flush=True)
        p, d = pd.prefills[0], pd.decode
        assert p.pid is not None and d.pid is not None
        sampler = CpuSampler({"P": p.pid, "D": d.pid})
        sampler.start()
        with router("push", [p.engine_spec.prefill_arg()], [d.url]) as url:
            for i in range(2):
                before, t = kv_sources(d.url), time.monotonic()
                body = {"model": "tiny", "prompt": prompt_text(20), "max_tokens": 8, "temperature": 0}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=150)
                prompt = r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None
                time.sleep(1.0)
                moved = kv_sources(d.url)["external_kv_transfer"] - before["external_kv_transfer"]
                print(f"request {i}: {r.status_code} in {time.monotonic() - t:.2f} s, prompt {prompt}, +{moved}")
            since, until = late_decode(p, d, p_tp)
        sampler.done.set()
        sampler.join(5)
    for what, means in (("whole run", sampler.means()), ("while P held the blocks", sampler.means(since, until))):
        print(f"CPU % per process, {what}: " + ", ".join(f"{k} {v}" for k, v in means.items() if v >= 0.5))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
    sys.exit(0)
