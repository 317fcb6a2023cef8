"""PNG plots of benchmark rows: metrics against load per series, and per-request CDFs (matplotlib, Agg, lazy)."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtest.job import REPO
from loadtest.records import ClientRecord, read_jsonl
from loadtest.results import Row


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series_name(row: Row) -> str:
    if row["router"] == "direct":
        return "direct"
    conn = str(row.get("connector") or "")
    tag = f" [{conn}]" if conn not in ("", "sim", "upstream-pull") else ""
    return f"{row['router']} {row['mode']}{tag}"


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _stat(row: Row, metric: str, stat: str) -> float | None:
    dist = row.get(metric)
    return None if not dist else dist.get(stat)


def vs_load(rows: Sequence[Row], x: str, panels: Sequence[tuple[str, Sequence[str]]], path: Path, title: str) -> Path:
    """One panel per (metric, stats); one line per series (router + mode) and stat, x = qps or concurrency."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    names = sorted({series_name(r) for r in rows})
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per series, one line style per stat
    for ax, (metric, stats) in zip(axes[0], panels, strict=True):
        for name in names:
            mine = [r for r in rows if series_name(r) == name and r.get(x) is not None]
            for stat, style in zip(stats, ("-o", "--s", ":^"), strict=False):
                at: dict[float, list[float]] = {}  # repeats of a point: plot their median
                for r in mine:
                    if (v := _stat(r, metric, stat)) is not None:
                        at.setdefault(r[x], []).append(v)
                xs = sorted(at)
                ys = [_median(at[k]) for k in xs]
                if xs:
                    ax.plot(xs, ys, style, color=colors[name], label=f"{name} {stat}")
        ax.set_xlabel(x)
        ax.set_ylabel(metric.replace("_ms", " (ms)"))
        if metric == "ttft_ms":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _records(row: Row) -> list[ClientRecord]:
    rel = row.get("records")
    if not rel:
        return []
    p = Path(rel) if Path(rel).is_absolute() else REPO / rel
    return read_jsonl(p) if p.exists() else []


def cdfs(
    rows: Sequence[Row], value: Callable[[ClientRecord], float | None], label: str, path: Path, title: str
) -> Path:
    """Empirical CDF of one per-request value, one line per row (series + load point)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    loads = sorted({(row.get("qps") or 0, row.get("concurrency") or 0) for row in rows})
    colour = {load: f"C{i % 10}" for i, load in enumerate(loads)}  # colour = load point, line style = front door + mode
    for row in rows:
        vals = sorted(v for r in _records(row) if r.ok and (v := value(r)) is not None)
        if not vals:
            continue
        load = f"qps {row['qps']}" if row.get("qps") is not None else f"c={row.get('concurrency')}"
        style = {"kvpush push": "-", "kvpush pull": "--", "vllm-router pull": ":"}.get(series_name(row), "-.")
        ax.step(
            vals,
            [(i + 1) / len(vals) for i in range(len(vals))],
            where="post",
            label=f"{series_name(row)} {load}",
            linestyle=style,
            color=colour[(row.get("qps") or 0, row.get("concurrency") or 0)],
        )
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_ms(r: ClientRecord) -> float | None:
    return None if r.ttft_s is None else r.ttft_s * 1000


def handoff_ms(r: ClientRecord) -> float | None:
    return r.handoff_ms


def suite_plots(suite: str, rows: Sequence[Row], out: Path, prefix: str = "") -> list[Path]:
    """Every plot of one suite's latest rows into `out` (files named after `prefix`, default the suite)."""
    if not rows:
        return []
    panels: list[tuple[str, tuple[str, ...]]]
    if suite == "overhead":
        panels = [("ttft_ms", ("p50", "p99")), ("e2e_ms", ("p50", "p99"))]
        return [vs_load(rows, "concurrency", panels, out / "overhead.png", "Front-door overhead (zero-cost workers)")]
    if suite == "link-wire":
        return []  # a table in the link section (report/link.py wire_part), no plot
    if suite == "link":
        return [link_bars(rows, out / "link.png"), cdfs(rows, ttft_ms, "TTFT (ms)", out / "link-ttft-cdf.png", "link")]
    name = prefix or suite
    panels = [("ttft_ms", ("mean", "p50", "p99")), ("tpot_ms", ("mean",)), ("handoff_ms", ("p50", "p99"))]
    files = [vs_load(rows, "qps", panels, out / f"{name}.png", f"{name}: TTFT, TPOT and KV handoff vs QPS")]
    files.append(cdfs(rows, ttft_ms, "TTFT (ms)", out / f"{name}-ttft-cdf.png", f"{name}: TTFT CDF"))
    with_handoff = [r for r in rows if r.get("handoff_ms")]
    if with_handoff:
        title = f"{name}: handoff CDF (prefill done -> decode first byte)"
        files.append(
            cdfs(with_handoff, handoff_ms, "router-measured KV handoff (ms)", out / f"{name}-handoff-cdf.png", title)
        )
    return files


LINK_SERIES = (
    ("kvpush", "upstream-pull"),
    ("kvpush", "upstream-push"),
    ("vllm-router", "upstream-push"),
    ("kvpush", "kvpush-push"),
    ("kvpush", "kvpush-progressive"),
)


def link_bars(rows: Sequence[Row], path: Path) -> Path:
    """The link suite: TTFT mean (median over repeats) per front, one group of bars per (preset, prompt, QPS)."""
    plt = _pyplot()
    points = sorted({(str(r.get("link")), int(r["input_len"]), float(r["qps"])) for r in rows if r.get("qps")})
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(points)), 4.5))
    width = 0.8 / len(LINK_SERIES)
    for k, (router, conn) in enumerate(LINK_SERIES):
        ys = []
        for preset, n, qps in points:
            vals = [
                v
                for r in rows
                if (r.get("link"), r["input_len"], r["qps"], r["router"], r["connector"])
                == (preset, n, qps, router, conn)
                and (v := _stat(r, "ttft_ms", "mean")) is not None
            ]
            ys.append(_median(vals) if vals else 0.0)
        xs = [i + (k - len(LINK_SERIES) / 2 + 0.5) * width for i in range(len(points))]
        ax.bar(xs, ys, width, label=f"{router} {conn}", color=f"C{k}")
    ax.set_xticks(range(len(points)), [f"{p}\n{n} tok, {q:g} QPS" for p, n, q in points], fontsize=7)
    ax.set_ylabel("TTFT mean (ms)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("link: TTFT mean per front on each emulated link (median over repeats)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
