"""TPOT against the decode batch it was made in (issue 41): ``python -m loadtest.micro.tpot_batch RUN_DIR...``.

A bench point's TPOT mean is set mostly by how many requests decoded at once, and that number feeds on itself
(Little's law: a slower step keeps each request decoding longer, so more of them overlap), so two fronts on the
same arrivals can differ by 20-40 % between repeats. This reads the points' ``requests.jsonl`` and fits, per
connector, one line over every request of every point:

    TPOT = base + per_decoding x decoding + per_waiting x waiting

where ``decoding`` is the time-averaged number of requests between their first token and their end while this one
decoded (itself included) and ``waiting`` the number between their arrival and their first token (on a push
decode those hold blocks and wait for their KV; on pull they are still at the prefill). ``base + per_decoding x b``
is then a step's time at batch ``b`` for that mode, compared at equal batches instead of at each repeat's own,
and ``per_waiting`` is what a request waiting for its first token costs the decoding ones, per token.
Pure but for reading the files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BatchSample:
    tpot_ms: float
    decoding: float  # requests decoding at once, time-averaged over this one's decode (itself included)
    waiting: float  # requests between arrival and first token, time-averaged over the same span


@dataclass(frozen=True)
class BatchFit:
    connector: str
    n: int
    base_ms: float
    per_decoding_ms: float
    per_waiting_ms: float
    stderr: tuple[float, float, float]
    r2: float

    def step_ms(self, batch: float) -> float:
        """The fitted TPOT at `batch` requests decoding and none waiting."""
        return self.base_ms + self.per_decoding_ms * batch


def _overlap(a: float, b: float, spans: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in spans) / (b - a)


def samples(records: Sequence[Mapping[str, Any]]) -> list[BatchSample]:
    """One sample per request that produced at least two tokens."""
    done = [r for r in records if r.get("ok") and int(r.get("output_tokens") or 0) > 1 and r["e2e_s"] > r["ttft_s"]]
    decode = [(r["sent"] + r["ttft_s"], r["sent"] + r["e2e_s"]) for r in done]
    wait = [(r["sent"], r["sent"] + r["ttft_s"]) for r in done]
    out = []
    for r, (a, b) in zip(done, decode, strict=True):
        tpot = (r["e2e_s"] - r["ttft_s"]) / (int(r["output_tokens"]) - 1) * 1e3
        out.append(BatchSample(tpot, _overlap(a, b, decode), _overlap(a, b, wait)))
    return out


def fit(connector: str, points: Sequence[BatchSample]) -> BatchFit:
    """Least squares over the samples (at least four)."""
    if len(points) < 4:
        raise ValueError(f"{connector}: {len(points)} samples, need at least 4")
    x = np.array([[1.0, s.decoding, s.waiting] for s in points])
    y = np.array([s.tpot_ms for s in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    var = float(resid @ resid) / max(1, len(y) - 3)
    stderr = np.sqrt(np.diag(var * np.linalg.pinv(x.T @ x)))
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(resid @ resid) / total if total > 0 else 1.0
    errors = (float(stderr[0]), float(stderr[1]), float(stderr[2]))
    return BatchFit(connector, len(y), float(coef[0]), float(coef[1]), float(coef[2]), errors, r2)


def by_connector(run_dirs: Sequence[Path]) -> dict[str, list[BatchSample]]:
    """Every point's requests under the run folders, grouped by the connector its folder is named after
    (``SUITE-ROUTER-MODE-CONNECTOR-qQPS-...``: a run folder holds no summary.json, its rows live in ``--results``)."""
    out: dict[str, list[BatchSample]] = {}
    for run in run_dirs:
        for point in sorted(run.glob("*/requests.jsonl")):
            connector = point.parent.name.split("-q")[0].split("-", 4)[-1]
            records = [json.loads(line) for line in point.read_text().splitlines() if line.strip()]
            out.setdefault(connector, []).extend(samples(records))
    return out


def table(fits: Sequence[BatchFit], batches: Sequence[float] = (1.0, 2.0, 4.0, 6.0)) -> str:
    head = " | ".join(f"TPOT at batch {b:g}" for b in batches)
    lines = [
        f"| connector | requests | base ms | ms per request decoding | ms per request waiting | {head} | R2 |",
        "|---|---|---|---|---|" + "---|" * len(batches) + "---|",
    ]
    for f in fits:
        cells = " | ".join(f"{f.step_ms(b):.2f}" for b in batches)
        lines.append(
            f"| {f.connector} | {f.n} | {f.base_ms:.2f} (+-{f.stderr[0]:.2f}) | {f.per_decoding_ms:.2f} "
            f"(+-{f.stderr[1]:.2f}) | {f.per_waiting_ms:+.2f} (+-{f.stderr[2]:.2f}) | {cells} | {f.r2:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench run folders (their point folders hold requests.jsonl)")
    a = ap.parse_args(argv)
    fits = [fit(c, s) for c, s in sorted(by_connector(a.runs).items())]
    print(table(fits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
