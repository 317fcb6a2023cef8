"""Minimal parser for the Prometheus text exposition format (no prometheus_client in loadtest)."""

import re
from collections.abc import Mapping

Sample = tuple[str, tuple[tuple[str, str], ...]]
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[Sample, float]:
    """{(name, sorted label pairs): value} for every sample line; comments and bad lines are skipped."""
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def total(samples: Mapping[Sample, float], name: str, **labels: str) -> float:
    """Sum of every sample of `name` whose labels include all of `labels` (e.g. over engine/model labels)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def by_label(samples: Mapping[Sample, float], name: str, label: str) -> dict[str, float]:
    """Sum of `name` grouped by the value of one label."""
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        if n == name:
            key = dict(lab).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
    return out
