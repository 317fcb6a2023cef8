"""What the deploy artefacts query: PromQL selectors of the dashboard and the alert rules, and exposition text.

`selectors(expr)` lists the metric names an expression reads with the label names it matches on and groups
by; `Exposition` reads a /metrics page into families so a name can be checked against what a process exports
(samples, or the families its `# TYPE` lines declare). Used by the unit tests and the live-scrape tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "kvpush-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"

AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan", "atan2"}
# Labels Prometheus adds at scrape time (the PodMonitors add `pool` and set `job`); `le` is every histogram's.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint", "pool"}
# Series Prometheus itself makes for every target.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$namespace": ".*"}

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<matchers>\{[^}]*\})
  | (?P<range>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-z]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<punct>[()\[\],])
  | (?P<op>[-+*/%^=!<>~]+)
  | (?P<space>\s+)
""",
    re.VERBOSE,
)
_MATCHER = re.compile(r"""\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')\s*(,|$)""")


@dataclass(frozen=True)
class Selector:
    """One metric an expression reads, with the labels its matchers name."""

    name: str
    matchers: frozenset[str]


@dataclass
class Usage:
    """Everything one expression reads: its selectors and the labels it groups or joins on."""

    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)

    @property
    def names(self) -> set[str]:
        return {s.name for s in self.selectors}


def substitute(expr: str) -> str:
    """The expression with Grafana's variables replaced by values Prometheus accepts."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group()))
    return out


def matcher_labels(block: str) -> set[str]:
    """Label names in a `{...}` matcher block."""
    inner, labels, pos = block[1:-1].strip(), set(), 0
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if m is None:
            raise ValueError(f"cannot read label matchers {block!r}")
        labels.add(m.group(1))
        pos = m.end()
    return labels


def usage(expr: str) -> Usage:
    """The metric names, matcher labels and grouping labels of one PromQL expression."""
    tokens = _tokens(substitute(expr))
    found = Usage()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "ident" and text in GROUPING and following == ("punct", "("):
            close = next(j for j in range(i + 2, len(tokens)) if tokens[j] == ("punct", ")"))
            found.grouping.update(t for k, t in tokens[i + 2 : close] if k == "ident")
            i = close + 1
            continue
        if kind == "ident" and text not in AGGREGATIONS | GROUPING | KEYWORDS and following != ("punct", "("):
            labels = matcher_labels(following[1]) if following[0] == "matchers" else set()
            found.selectors.append(Selector(text, frozenset(labels)))
        i += 1
    return found


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, expr) of every query in the dashboard, templating queries included."""
    board = json.loads(path.read_text())
    out = [(p["title"], t["expr"]) for p in _panels(board["panels"]) for t in p.get("targets", [])]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        m = re.fullmatch(r"label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)", str(text or ""))
        if variable.get("type") == "query" and m:
            out.append((f"variable {variable['name']}", f"group by ({m['label']}) ({m['metric']})"))
    return out


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def rule_exprs(groups: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """(rule name, expr) of every rule in the plain rules file (or in the given groups)."""
    if groups is None:
        groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in groups for r in g["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs() + rule_exprs()


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+\S+(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:\\.|[^"\\])*"')
_DERIVED = {
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "counter": ("", "_total", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


class Exposition:
    """A /metrics page: the sample names it has (with their labels) and the families its TYPE lines declare."""

    def __init__(self, text: str) -> None:
        self.labels: dict[str, set[str]] = {}
        self.types: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                self.types[name] = kind.strip()
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                if m is None:
                    raise ValueError(f"not an exposition sample line: {line!r}")
                self.labels.setdefault(m["name"], set()).update(_LABEL.findall(m["labels"] or ""))

    def declared(self) -> set[str]:
        """Every series name the TYPE lines promise, whether or not a sample is there yet."""
        names: set[str] = set()
        for family, kind in self.types.items():
            base = family.removesuffix("_total") if kind == "counter" else family
            names.update(base + suffix for suffix in _DERIVED.get(kind, ("",)))
        return names

    def exports(self, name: str) -> bool:
        return name in self.labels or name in self.declared()

    def labels_of(self, name: str) -> set[str] | None:
        """The label names the samples of `name` carry (`le` included), or None when it has no samples yet."""
        return self.labels.get(name)


def promtool_path() -> str | None:
    """promtool from PATH, else the copy deploy/tools/install-promtool.sh puts in .cache/tools/bin."""
    import shutil

    local = REPO / ".cache" / "tools" / "bin" / "promtool"
    return shutil.which("promtool") or (str(local) if local.is_file() else None)


def require_promtool() -> str:
    """The promtool path; skips the test without one, or fails when KVPUSH_REQUIRE_PROMTOOL=1 (CI)."""
    import os

    import pytest

    found = promtool_path()
    if found is None:
        reason = "promtool not found: run deploy/tools/install-promtool.sh (puts it in .cache/tools/bin)"
        if os.environ.get("KVPUSH_REQUIRE_PROMTOOL") == "1":
            pytest.fail(reason + " (KVPUSH_REQUIRE_PROMTOOL=1)")
        pytest.skip(reason)
    return found
