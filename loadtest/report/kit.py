"""Shared pieces of the bench report: reading a row's stats, medians and spreads over repeats, target verdicts."""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.results import Row


def stat(row: Row | None, metric: str, name: str) -> float | None:
    """A distribution's statistic (`ttft_ms`, `p50`), or a plain field when `name` is empty (`req_per_s`, '')."""
    if row is None:
        return None
    value = row.get(metric)
    if not name:
        return None if value is None else float(value)
    if not value:
        return None
    v = value.get(name)
    return None if v is None else float(v)


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass(frozen=True)
class Agg:
    """One statistic over the repeats of a point: median, min, max and how many repeats had it."""

    med: float
    lo: float
    hi: float
    k: int

    @property
    def spread(self) -> float:
        """(max - min) / median: the drift between repeats."""
        return (self.hi - self.lo) / self.med if self.med else 0.0

    def text(self, digits: int = 1) -> str:
        if self.k == 1:
            return f"{self.med:.{digits}f}"
        return f"{self.med:.{digits}f} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"


def cell(a: Agg | None, digits: int = 1) -> str:
    """A table cell: median (min-max) over the repeats, or "-"."""
    return "-" if a is None else a.text(digits)


def kv_ext_pct(r: Row) -> float | None:
    """The share of decode's prompt tokens that arrived by KV transfer, in %."""
    v = r.get("kv_external_frac")
    return None if v is None else 100 * float(v)


def agg(rows: Iterable[Row], metric: str, name: str) -> Agg | None:
    vals = [v for r in rows if (v := stat(r, metric, name)) is not None]
    if not vals:
        return None
    return Agg(median(vals), min(vals), max(vals), len(vals))


def agg_of(rows: Iterable[Row], value: Callable[[Row], float | None]) -> Agg | None:
    vals = [v for r in rows if (v := value(r)) is not None]
    return Agg(median(vals), min(vals), max(vals), len(vals)) if vals else None


def group(rows: Iterable[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    out: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return out


@dataclass(frozen=True)
class Verdict:
    """One target at one point: ours against a limit derived from a reference."""

    target: str
    point: str
    ours: float | None
    ref: float | None
    limit: float | None
    lower_is_better: bool = True
    unit: str = "ms"

    @property
    def met(self) -> bool | None:
        if self.ours is None or self.limit is None:
            return None
        return self.ours <= self.limit if self.lower_is_better else self.ours >= self.limit

    def cells(self) -> list[str]:
        ratio = "-" if self.ours is None or not self.ref else f"{self.ours / self.ref:.2f}x"
        if self.met is None:
            verdict, by = "n/a", "-"
        else:
            assert self.ours is not None and self.limit is not None
            gap = self.ours - self.limit
            verdict = "**met**" if self.met else "**missed**"
            pct = f" ({100 * abs(gap) / abs(self.limit):.0f} %)" if self.limit else ""
            side = "inside" if self.met else "over" if self.lower_is_better else "short"
            by = f"{abs(gap):.2f} {self.unit}{pct} {side}"
        return [self.target, self.point, fmt(self.ours, 2), fmt(self.ref, 2), fmt(self.limit, 2), ratio, verdict, by]


def verdict_table(verdicts: Sequence[Verdict]) -> list[str]:
    if not verdicts:
        return ["(no rows to judge the targets on)"]
    met = sum(1 for v in verdicts if v.met)
    judged = sum(1 for v in verdicts if v.met is not None)
    out = [
        f"Targets met: {met} of {judged} judged.",
        "",
        "| target | point | ours | reference | limit | ours / reference | verdict | by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += ["| " + " | ".join(v.cells()) + " |" for v in verdicts]
    return out
