"""Suite "link": the cpu-vllm fronts with P and D on an emulated network (stack/link), one preset at a time.

Every engine runs in its own network namespace behind a token-bucket-shaped veth (stack.link.fabric.Link); the
KV goes over UCX's TCP transport across it. Pairs (P on core 0, D on core 1): upstream pull (NixlConnector),
upstream push (NixlPushConnector) and ours (KvpushConnector) with its prefills on one decode, on the product
default (since 2026-12-07 layer-wise push: each layer's blocks written as soon as it is computed,
connector/transfer/layered.py): `p0` prefills a prompt in one step (`kvpush-push`), `p1` in chunks of
`chunk_tokens` (`kvpush-progressive`: each chunk's WRITE leaves during its step, overlapping the rest of the
prefill); with `step` a third prefill, `p2`, is the candidate the default replaced: one WRITE at the end of the
one step (`kvpush-step`, `push_granularity: step`). Runs before that default had `kvpush-push` step-wise and a
layer-wise `p2` (`kvpush-layer`); a layer-wise prefill in chunks (`kvpush-layer-chunked`) was deleted as a front
(bench/ANALYSIS.md, "Options deleted") and is what `kvpush-progressive` does now. The report shows old rows
under their names. Our engines run the connector's product default progress model unless the plan's `progress`
names one (`--set progress=poll` or `thread`), so the runs of record measure what users get and a candidate runs
against the same pull in its own run; rows record `push_granularity` and `progress`. Fronts: kvpush on
every pair, vllm-router 0.1.17 on upstream push.

For every step (linkrows.steps: a prompt length and a preset) the suite measures P's prefill (calibrate), sets
the link's rate from it, then runs every point, repeats alternating the fronts' order. Each row records the
link (preset, rate, measured prefill, expected wire time), the mean KV transfer time the connectors measured
(their xfer-time histograms), and the bytes that left P's NIC against the KV bytes D received by transfer:
fewer means the KV bypassed the link (UCX's cma shortcut) and the row fails (`link_bytes_ok` false).
Before the first step every front answers a few greedy prompts that P answers alone; rows carry the agreement.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from connector.options import PROGRESS_MODELS, Options
from loadtest import promtext
from loadtest.bench import linkrows
from loadtest.bench.fronts import Front
from loadtest.bench.point import measure, scrape
from loadtest.bench.procs import router_proc, url, vllm_lock, vrouter_binary, vrouter_proc
from loadtest.bench.suites.cpu import engine_point, front_labels
from stack.engines import Engine, Fleet
from stack.family import PdEngines, PdFamily, pd_family, start_family
from stack.link.calibrate import Calibration, calibrate
from stack.link.fabric import Link
from stack.link.plan import BASE_NETWORK, Shaping, nominal_prefill_s, preset, resolve
from stack.local import StackOptions, ensure_model
from stack.procs import free_port
from stack.tiny_model import resolve_size

MODEL_SIZE = "bench"
SUITE = "link"
STEP = {"push_granularity": "step"}  # p2: a step's blocks in one WRITE at its end, the default until 2026-12-07
CHECK_PROMPTS = ("def f0(x): return x * 0\ndef f1(x):", "The link between prefill and decode carries")


@dataclass(frozen=True)
class LinkBenchPlan:
    input_lens: tuple[int, ...] = (1024, 4096)
    output_len: int = 64
    presets: tuple[str, ...] = ("ethernet-100g-like", "efa-like", "ethernet-25g-like")  # the first: the targets'
    qps: tuple[float, ...] = (1.0, 3.0)  # the headline step (presets[0] at input_lens[0])
    repeats: int = 3
    side_qps: tuple[float, ...] = (1.0,)  # every other step, capped by max_load
    side_repeats: int = 1
    max_load: float = 0.7  # a side step loads P and the link to at most this share
    requests: int = 16
    max_point_s: float = 8.0  # fewer requests at light points (at least 4)
    warmup: int = 1
    chunk_tokens: int = 256  # kvpush-progressive's P: --max-num-batched-tokens (a multiple of the 128-token block)
    step: bool = True  # the step-wise candidate prefill (kvpush-step)
    one_step: bool = True  # kvpush-push (our step-wise push of a one-step prefill)
    vrouter: bool = True
    model: str = MODEL_SIZE  # stack/tiny_model.py SIZES: "bench" (4 layers), "bench-deep" (16 thin layers)
    progress: str = ""  # our engines' `progress` (connector/options.py): "" = the product default, else a candidate

    def __post_init__(self) -> None:
        if self.progress not in ("", *PROGRESS_MODELS):
            raise ValueError(f"link progress: {self.progress!r} is not one of {list(PROGRESS_MODELS)} (or empty)")

    @property
    def ours_extra(self) -> dict[str, str]:
        """kv_connector_extra_config of our engines: nothing (the product default) or the candidate progress model."""
        return {"progress": self.progress} if self.progress else {}

    @property
    def progress_model(self) -> str:
        """The progress model our engines run, recorded in every row."""
        chosen = Options(progress=self.progress or Options.progress)
        return chosen.progress_model(str(BASE_NETWORK.network_address + 1))  # engines in namespaces: not loopback

    def steps(self) -> list[linkrows.Step]:
        return linkrows.steps(self.input_lens, self.presets, self.qps, self.repeats, self.side_qps, self.side_repeats)

    @property
    def max_model_len(self) -> int:
        return max(self.input_lens) + self.output_len + 128


# ~4 min boot (6 engines) + headline 2 QPS x 3 repeats x 5 fronts (~10 s each) + 5 side steps x 5 fronts (~10-25 s)
FULL = LinkBenchPlan()
SMOKE = LinkBenchPlan(
    input_lens=(256,),
    output_len=8,
    presets=("ethernet-100g-like",),
    qps=(1.0,),
    repeats=1,
    requests=3,
    max_point_s=0.0,
    warmup=0,
    chunk_tokens=128,
    vrouter=False,
)


@dataclass(frozen=True)
class Pair:
    """A front's P and D, by engine name (the NIC to meter) and handle."""

    front: Front
    p: Engine


def families(plan: LinkBenchPlan, model: Path) -> list[PdFamily]:
    batched = ("--max-num-batched-tokens", str(plan.max_model_len))  # one step per prompt unless asked otherwise
    common: dict[str, Any] = {"extra_args": batched, "max_model_len": plan.max_model_len}
    prefill_args: list[tuple[str, ...]] = [(), ("--max-num-batched-tokens", str(plan.chunk_tokens))]
    if plan.step:
        prefill_args.append(())
    ours = pd_family(
        "ln-ours",
        model,
        "KvpushConnector",
        module="connector.plugin",
        n_prefill=len(prefill_args),
        prefill_args=prefill_args,
        connector_extra=plan.ours_extra,
        **common,
    )
    # p2: the same connector on the same decode, one WRITE per step (a prefill-side option)
    prefills = tuple(
        dataclasses.replace(spec, connector_extra={**plan.ours_extra, **STEP}) if i >= 2 else spec
        for i, spec in enumerate(ours.prefills)
    )
    return [
        pd_family("ln-pull", model, "NixlConnector", **common),
        pd_family("ln-upush", model, "NixlPushConnector", **common),
        PdFamily(prefills=prefills, decodes=ours.decodes),
    ]


def _kvpush(fleet: Fleet, tag: str, mode: str, p: Engine, d: Engine, conn: str, logs: Path) -> Pair:
    port = free_port()
    proc = fleet.start(router_proc(f"router-{tag}", port, mode, p.engine_spec.prefill_arg(), d.url, logs))
    proc.wait_healthy(timeout=60.0)
    return Pair(Front("kvpush", mode, url(port), proc, p.url, d.url, conn), p)


def start_fronts(
    fleet: Fleet, pull: PdEngines, upush: PdEngines, ours: PdEngines, logs: Path, vrouter: bool, one_step: bool = True
) -> list[Pair]:
    out = [
        _kvpush(fleet, "pull", "pull", pull.prefills[0], pull.decode, "upstream-pull", logs),
        _kvpush(fleet, "upush", "push", upush.prefills[0], upush.decode, "upstream-push", logs),
    ]
    binary = vrouter_binary() if vrouter else None
    if binary is not None:
        port, prom = free_port(), free_port()
        p, d = upush.prefills[0], upush.decode
        proc = fleet.start(vrouter_proc("vllm-router-upush", port, prom, p.url, d.url, logs, binary))
        proc.wait_healthy(timeout=120.0)
        out.append(Pair(Front("vllm-router", "push", url(port), proc, p.url, d.url, "upstream-push"), p))
    elif vrouter:
        print("link: vllm-router not found (.venv-vrouter); its rows are skipped")
    if one_step:
        out.append(_kvpush(fleet, "ours", "push", ours.prefills[0], ours.decode, "kvpush-push", logs))
    out.append(_kvpush(fleet, "prog", "push", ours.prefills[1], ours.decode, "kvpush-progressive", logs))
    if len(ours.prefills) >= 3:
        out.append(_kvpush(fleet, "step", "push", ours.prefills[2], ours.decode, "kvpush-step", logs))
    return out


def _complete(base: str, prompt: str, timeout_s: float = 120.0) -> str | None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    try:
        resp = httpx.post(base.rstrip("/") + "/v1/completions", json=body, timeout=timeout_s)
        resp.raise_for_status()
        return str(resp.json()["choices"][0]["text"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def output_check(pairs: list[Pair], single: str) -> dict[tuple[str, str], list[int]]:
    """Greedy answers of every front against the same prompts sent to one prefill engine alone."""
    reference = [_complete(single, p) or "" for p in CHECK_PROMPTS]
    out = {}
    for pair in pairs:
        got = [_complete(pair.front.base, p) for p in CHECK_PROMPTS]
        out[(pair.front.router, pair.front.connector)] = linkrows.outputs_agree(reference, got)
    print(f"link: outputs equal to one instance alone: {out}")
    return out


def xfer_counters(urls: Mapping[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of every connector xfer-time histogram on the engines `urls` (name -> URL)."""
    out = {}
    for name, base in urls.items():
        samples = scrape(base)
        for metric in linkrows.XFER_METRICS:
            count = promtext.total(samples, metric + "_count")
            if count:
                out[f"{name}:{metric}"] = (promtext.total(samples, metric + "_sum"), count)
    return out


def run(plan: LinkBenchPlan, run_dir: Path, summary: Path, progress: bool, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    logs = run_dir / "logs"
    per_token = resolve_size(plan.model).kv_bytes_per_token()  # ValueError naming the known sizes
    model = ensure_model(StackOptions(model_size=plan.model))
    first = plan.steps()[0]
    start = resolve(
        preset(first.preset), prefill_s=nominal_prefill_s(first.input_len), kv_bytes=first.input_len * per_token
    )
    with vllm_lock(), Link(start.shaping or Shaping.for_rate(1e9)) as link, Fleet(logs) as fleet:
        started = [start_family(fleet, fam, timeout=600.0, link=link) for fam in families(plan, model)]
        pairs = start_fronts(fleet, started[0], started[1], started[2], logs, plan.vrouter, plan.one_step)
        agree = output_check(pairs, started[0].prefills[0].url)
        for k, step in enumerate(plan.steps()):
            cal = calibrate(
                link,
                preset(step.preset),
                started[0].prefills[0].url,
                prompt_tokens=step.input_len,
                kv_bytes_per_token=per_token,
            )
            print(f"link: step {k} {step.preset} {step.input_len} tokens: {cal.record()}")
            transfer = cal.plan.expected_transfer_s
            for i, asked in enumerate(step.qps):
                # the headline step runs its QPS as asked (the targets name them); the others stay below max_load
                qps = (
                    asked if step.headline else linkrows.capped_qps(asked, cal.plan.prefill_s, transfer, plan.max_load)
                )
                for rep in range(step.repeats):
                    order = pairs if rep % 2 == 0 else pairs[::-1]
                    for j, pair in enumerate(order):
                        ctx = _Ctx(plan, step, cal, link, pair, per_token, run_id, run_dir, summary, progress)
                        agreed = agree[(pair.front.router, pair.front.connector)]
                        rows.append(ctx.point(qps, asked, linkrows.point_seed(k, i), rep, j, agreed))
    return rows


@dataclass(frozen=True)
class _Ctx:
    plan: LinkBenchPlan
    step: linkrows.Step
    cal: Calibration
    link: Link
    pair: Pair
    per_token: int
    run_id: str
    run_dir: Path
    summary: Path
    progress: bool

    def point(self, qps: float, asked: float, seed: int, rep: int, order: int, agreed: list[int]) -> dict[str, Any]:
        front, step = self.pair.front, self.step
        extra: dict[str, Any] = {
            "run_id": self.run_id,
            "model": self.plan.model,
            "repeat": rep,
            "order": order,
            "headline": step.headline,
            "qps_asked": asked,
            "seed": seed,
            "chunk_tokens": self.plan.chunk_tokens,
            **self._options(),
            "warmup": self.plan.warmup,
            "outputs_equal_single": agreed,
            **self.cal.record(),
        }
        labels = front_labels(SUITE, front, qps, step.input_len, self.plan.output_len)
        n = linkrows.n_for(qps, self.plan.requests, self.plan.max_point_s)
        point = engine_point(front, labels, n, seed, self.plan.warmup, extra)
        engines = {self.pair.p.engine_spec.name: self.pair.p.url, "d": front.d_url or ""}
        before = xfer_counters(engines)
        meter = self.link.meter(self.pair.p.engine_spec.name)
        since = time.monotonic()

        def finish(sofar: Mapping[str, Any]) -> Mapping[str, Any]:
            kv = linkrows.kv_bytes(sofar.get("decode_prompt_tokens_by_source"), self.per_token)
            check = meter.check(kv)
            if not check.ok:
                print(f"link: {front.router}/{front.connector} FAILS the bytes check: {check.verdict}")
            timing = linkrows.transfer_times(before, xfer_counters(engines))
            return {**check.record(), **timing, "link_window_s": round(time.monotonic() - since, 3)}

        where = self.run_dir / f"{step.preset}-{step.input_len}"  # one folder per step: the fronts' names repeat
        return measure(point, where, self.summary, self.progress, finish=finish)

    def _options(self) -> dict[str, str | None]:
        """Our connector's options on this row's prefill (None on the upstream pairs)."""
        if not self.pair.front.connector.startswith("kvpush"):
            return {"progress": None, "push_granularity": None}
        step = self.pair.front.connector == "kvpush-step"
        return {"progress": self.plan.progress_model, "push_granularity": "step" if step else Options.push_granularity}
