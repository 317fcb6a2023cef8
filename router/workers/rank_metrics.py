"""Per-rank facts from one vLLM /metrics page: each data-parallel rank's load, and the KV block size. Pure.

vLLM labels its per-engine gauges with `engine="<index>"`; on a server started with `--data-parallel-size N` the
index is the data-parallel rank (`v1/metrics/loggers.py`). `scrape.parse_engine_load` sums over engines for the
worker's own load; `rank_loads` keeps them apart for the rank chooser (`ranks.RankSet.set_loads`).
`vllm:cache_config_info` is an info gauge whose labels carry the cache config, `block_size` among them:
`block_size` reads it, so the router can refuse a prefill/decode pair whose block sizes differ (upstream push
0.34 refuses it at the handshake, `pairing.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from router.domain import EngineLoad

__all__ = ["CACHE_INFO", "MetricsPageError", "block_size", "closing_brace", "labelled_samples", "rank_loads"]

# vLLM's names; router/workers/scrape.py (which imports httpx) reads them from here.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second is the pre-0.10 name
CACHE_INFO = "vllm:cache_config_info"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_MAX_LABELS_CHARS = 4096  # one label set; vLLM's longest (cache_config_info) is a few hundred characters


class MetricsPageError(ValueError):
    """A /metrics line that is not the Prometheus text format. (The scraper treats it as a failed scrape, as it
    treats its own ScrapeError: wiring the two together is scrape.py's, when it reads ranks.)"""


def labelled_samples(text: str, wanted: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of the metrics in `wanted` (other lines are not parsed)."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(wanted):
            continue
        match = _NAME.match(line)
        if match is None or match.group() not in wanted:
            continue  # a longer name that shares the prefix
        labels: dict[str, str] = {}
        rest = line[match.end() :]
        if rest.startswith("{"):
            end = closing_brace(rest)
            if end == -1 or end > _MAX_LABELS_CHARS:
                raise MetricsPageError(f"unclosed or oversized label set: {line[:200]!r}")
            labels = _labels(rest[1:end], line)
            rest = rest[end + 1 :]
        fields = rest.split()
        if not fields:
            raise MetricsPageError(f"a sample without a value: {line[:200]!r}")
        try:
            yield match.group(), labels, float(fields[0])
        except ValueError:
            raise MetricsPageError(f"a sample value that is not a number: {line[:200]!r}") from None


def closing_brace(text: str) -> int:
    """Index of the `}` closing the label set that `text` opens, or -1; quoted values may hold `}` and `\\"`."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1


def _labels(body: str, line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        match = _LABEL.match(body, pos)
        if match is None:
            raise MetricsPageError(f"a malformed label set: {line[:200]!r}")
        out[match[1]] = match[2].replace('\\"', '"').replace("\\\\", "\\")
        pos = match.end()
    return out


def rank_loads(text: str) -> dict[int, EngineLoad]:
    """Each engine index's load (running, waiting, KV usage) in one page; indexes without both request gauges
    are left out. Samples without an `engine` label count as engine 0 (a server without data parallelism)."""
    found: dict[int, dict[str, float]] = {}
    for name, labels, value in labelled_samples(text, (RUNNING, WAITING, *KV_USAGE)):
        index = labels.get("engine", "0")
        if not index.isdigit() or len(index) > 4 or math.isnan(value):
            continue
        per = found.setdefault(int(index), {})
        key = "kv" if name in KV_USAGE else name
        per.setdefault(key, value)  # the first of the two KV names wins (the current one is listed first)
    out: dict[int, EngineLoad] = {}
    for rank, per in found.items():
        if RUNNING in per and WAITING in per:
            kv = min(1.0, max(0.0, per.get("kv", 0.0)))
            out[rank] = EngineLoad(running=round(per[RUNNING]), waiting=round(per[WAITING]), kv_usage=kv)
    return out


def block_size(text: str) -> int | None:
    """The KV block size (tokens) the page's engines run with, from `vllm:cache_config_info`; None when the page
    does not say. Raises MetricsPageError when its engines disagree (they cannot: one server, one cache config)."""
    sizes = set()
    for _, labels, _ in labelled_samples(text, (CACHE_INFO,)):
        value = labels.get("block_size", "")
        if value.isdigit() and 0 < len(value) <= 6 and int(value) > 0:
            sizes.add(int(value))
    if len(sizes) > 1:
        raise MetricsPageError(f"engines of one server state different block sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else None
