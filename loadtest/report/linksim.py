"""The simulator against the link runs (issue 21 item 6), pure: every kvpush row of a link run replayed in the
virtual pair (sim/scaled.py) on a profile from the row's own measurements and its planned send times, so the
table is a function of summary.json alone (no git-ignored request records). Two link models side by side:
one transfer at a time (FIFO, the model before) and the fair-share link (overlapping transfers share the
rate, each pays TCP's start: sim/link.py), with the median |gap| per preset."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.report.kit import agg, fmt, group, median
from loadtest.results import Row
from loadtest.sim.scaled import Measured, predict_at

PULL, UP, OURS, PROG = "upstream-pull", "upstream-push", "kvpush-push", "kvpush-progressive"
SIM_MODE = {PULL: "pull", UP: "upstream-push", OURS: "kvpush-push", PROG: "kvpush-progressive"}


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


def legacy_seed(step_index: int, qps_index: int) -> int:
    """The link suite's seed rule (bench/linkrows.point_seed, one floor up) for rows stored before they recorded
    their `seed`: 4000 + 10 x the step's position in the run + the QPS's in the step."""
    return 4000 + 10 * step_index + qps_index


def arrival_seeds(rows: Sequence[Row]) -> dict[int, int]:
    """id(row) -> the arrival seed its point sent on: the row's `seed`, or `legacy_seed` for older rows (the
    step's position among the run's (prompt length, preset) steps in time order, the QPS's within the step)."""
    order: list[tuple[int, str]] = []
    asked: dict[tuple[int, str], list[Any]] = {}
    for r in sorted(rows, key=lambda r: str(r.get("created") or "")):
        step = (int(r["input_len"]), str(r.get("link")))
        if step not in order:
            order.append(step)
        seen = asked.setdefault(step, [])
        if r.get("qps_asked", r["qps"]) not in seen:
            seen.append(r.get("qps_asked", r["qps"]))
    out = {}
    for r in rows:
        step = (int(r["input_len"]), str(r.get("link")))
        legacy = legacy_seed(order.index(step), asked[step].index(r.get("qps_asked", r["qps"])))
        out[id(r)] = int(r["seed"]) if r.get("seed") is not None else legacy
    return out


def planned_sends(r: Row, seed: int) -> list[float]:
    """The send times the point planned (its open-loop schedule: the row's QPS, seed and request count); the
    load generator keeps to it, so the simulator replays it instead of the request records."""
    return schedule(ArrivalSpec(float(r["qps"]), 1.0, seed), int(r["n"]))


def predicted(r: Row, conn: str, chunk_tokens: int, seed: int, shared: bool = True) -> tuple[float, float] | None:
    """(TTFT mean, handoff p50) the simulator predicts for one measured row; `shared`: the fair-share link."""
    prefill, tpot = _f(r.get("link_prefill_s")), _f((r.get("tpot_ms") or {}).get("mean"))
    if prefill is None or tpot is None or conn not in SIM_MODE:
        return None
    m = Measured(prefill, tpot / 1000, _f(r.get("link_rate_bit_s")), int(r["input_len"]), shared=shared)
    s = predict_at(m, SIM_MODE[conn], planned_sends(r, seed), int(r["output_len"]), chunk_tokens)
    return s.ttft_mean_ms, s.handoff_p50_ms


@dataclass(frozen=True)
class Comparison:
    """One (prompt, preset, QPS, connector) of a link run: measured and predicted medians over its repeats."""

    input_len: int
    preset: str
    qps: float
    connector: str
    ttft: float | None
    handoff: float | None
    fair: tuple[float, float]  # predicted (TTFT mean, handoff p50), fair-share link
    fifo: tuple[float, float]  # the same, one transfer at a time


def points(rows: Sequence[Row], chunk_tokens: int) -> list[Comparison]:
    """Every kvpush point of the run that the simulator models, in the table's order."""
    seeds = arrival_seeds(rows)
    out = []
    # the layer-wise connectors are not modelled
    kvpush = [r for r in rows if r.get("router") == "kvpush" and r.get("connector") in SIM_MODE]
    for (n, preset, qps, conn), rs in sorted(
        group(kvpush, "input_len", "link", "qps", "connector").items(),
        key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2], list(SIM_MODE).index(kv[0][3])),
    ):
        model = {
            shared: [p for r in rs if (p := predicted(r, str(conn), chunk_tokens, seeds[id(r)], shared)) is not None]
            for shared in (True, False)
        }
        if not model[True]:
            continue
        fair, fifo = ((median([p[0] for p in ps]), median([p[1] for p in ps])) for ps in (model[True], model[False]))
        ttft, hand = _med(rs, "ttft_ms", "mean"), _med(rs, "handoff_ms", "p50")
        out.append(Comparison(int(n), str(preset), float(qps), str(conn), ttft, hand, fair, fifo))
    return out


def _med(rows: Sequence[Row], metric: str, name: str) -> float | None:
    a = agg(rows, metric, name)
    return None if a is None else a.med


def gap(measured: float | None, predicted: float) -> float | None:
    """(measured - predicted) / predicted, or None where either is missing."""
    if measured is None or not predicted or predicted != predicted:
        return None
    return (measured - predicted) / predicted


def _pct(g: float | None) -> str:
    return "-" if g is None else f"{100 * g:+.0f} %"


def table(pts: Sequence[Comparison]) -> list[str]:
    """Measured against the fair-share link's prediction, per point."""
    out = [
        "| preset | prompt | QPS | connector | TTFT mean measured / predicted (ms) | handoff p50 measured / predicted "
        "| gap TTFT | gap handoff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        (p_ttft, p_hand) = p.fair
        out.append(
            f"| {p.preset} | {p.input_len} | {p.qps:g} | {p.connector} | {fmt(p.ttft)} / {p_ttft:.1f} "
            f"| {fmt(p.handoff)} / {p_hand:.1f} | {_pct(gap(p.ttft, p_ttft))} | {_pct(gap(p.handoff, p_hand))} |"
        )
    return out


def error_by_preset(pts: Sequence[Comparison]) -> dict[str, dict[str, float]]:
    """preset -> median |gap| of handoff and TTFT under each link model ("fifo", "fair"), as fractions."""
    out: dict[str, dict[str, float]] = {}
    for preset in sorted({p.preset for p in pts}):
        mine = [p for p in pts if p.preset == preset]
        cells: dict[str, float] = {}
        for name in ("fifo", "fair"):
            for metric, i in (("handoff", 1), ("ttft", 0)):
                gaps = [abs(g) for p in mine if (g := gap(getattr(p, metric), getattr(p, name)[i])) is not None]
                if gaps:
                    cells[f"{metric} {name}"] = median(gaps)
        out[preset] = cells
    return out


def error_table(pts: Sequence[Comparison]) -> list[str]:
    out = [
        "| preset | points | handoff: one at a time | handoff: fair share | TTFT: one at a time | TTFT: fair share |",
        "|---|---|---|---|---|---|",
    ]
    for preset, c in error_by_preset(pts).items():
        n = sum(1 for p in pts if p.preset == preset)
        cells = " | ".join(
            "-" if (v := c.get(k)) is None else f"{100 * v:.0f} %"
            for k in ("handoff fifo", "handoff fair", "ttft fifo", "ttft fair")
        )
        out.append(f"| {preset} | {n} | {cells} |")
    return out


TEXT = (
    "Predicted by the virtual-time pair (loadtest/sim/scaled.py) on a profile built from each row's own "
    "measurements: P's prefill (the calibration median), the decode step (the row's TPOT), the shaped goodput as "
    "the network, the bench model's 4 KiB of KV per token, and the point's planned send times (its seed, QPS "
    "and request count: every input is in summary.json); router, HTTP and API time are not modelled; medians "
    "over the repeats. The link is fair-share: transfers in flight at once share the rate (two at once each "
    "take twice as long), each after TCP's start (a round trip plus slow start to the bandwidth-delay product, "
    "the veth's 40 us round trip: the presets add no delay). `gap` = (measured - predicted) / predicted."
)


def section(rows: Sequence[Row], chunk_tokens: int) -> list[str]:
    pts = points(rows, chunk_tokens)
    return [
        TEXT,
        "",
        *table(pts),
        "",
        "Median |gap| per preset over the points above, the link as one transfer at a time (the model before) "
        "and as fair share:",
        "",
        *error_table(pts),
    ]
