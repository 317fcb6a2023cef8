"""The soak's figures as Markdown for bench/faults/README.md, from its soak.json (pure)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _series_rows(samples: Sequence[Mapping[str, Any]], warmup_s: float) -> list[str]:
    names = sorted({k for s in samples for k in s["values"]})
    kept = [s for s in samples if s["t"] >= warmup_s]
    rows = []
    for name in names:
        values = [float(s["values"].get(name, 0.0)) for s in kept]
        if not values:
            continue
        fmt = "{:.2%}" if name.endswith("kv_usage") else "{:.1f}" if name.endswith("rss_mib") else "{:g}"
        first, last = values[0], values[-1]
        cells = [fmt.format(v) for v in (first, min(values), max(values), last)]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def markdown(report: Mapping[str, Any]) -> str:
    samples = report["samples"]
    lines = [
        f"Traffic {report['duration_s'] / 60:.0f} min at {report['rate_jobs_s']:.2f} jobs/s "
        f"({report['rate_jobs_s'] / report['capacity_jobs_s']:.0%} of the {report['capacity_jobs_s']:.2f} jobs/s a "
        f"closed-loop probe measured), {report['arrivals']} jobs, {len(samples)} samples, warm-up "
        f"{report['warmup_s'] / 60:.0f} min not judged. Verdict: "
        + ("**passed**" if report["ok"] else "**failed**: " + "; ".join(report["reasons"])),
        "",
        "Outcomes by kind: "
        + "; ".join(f"{k}: " + ", ".join(f"{lab} x{n}" for lab, n in c.items()) for k, c in report["outcomes"].items()),
        *_unexpected_rows(report.get("unexpected_details") or ()),
        "",
        "| series (after warm-up) | first | min | max | last |",
        "|---|---|---|---|---|",
        *_series_rows(samples, report["warmup_s"]),
        "",
        "Trends (median of the first third vs the last third after warm-up): "
        + "; ".join(f"{t['name']} {t['first']:.4g} -> {t['last']:.4g} ({t['change']:+.1%})" for t in report["trends"]),
        "",
        "Left at the end: " + (", ".join(report["left"]) or "nothing"),
        "",
        "WRITE shape at the start: " + _shape(report["write_shape_start"]),
        "WRITE shape at the end: " + _shape(report["write_shape_end"]),
    ]
    return "\n".join(lines) + "\n"


def _unexpected_rows(details: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each unexpected outcome: when it began, its kind and label, and why (with the x-request-id it carried)."""
    if not details:
        return []
    rows = ["", "| began (min) | kind | outcome | after s | why |", "|---|---|---|---|---|"]
    for d in details:
        why = str(d.get("detail") or "-").replace("|", "/")
        rows.append(f"| {d['began_s'] / 60:.1f} | {d['kind']} | {d['label']} | {d['seconds']:.1f} | {why} |")
    return rows


def _shape(shape: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in shape.items()) or "no WRITE"


if __name__ == "__main__":
    sys.stdout.write(markdown(json.loads(Path(sys.argv[1]).read_text())))
