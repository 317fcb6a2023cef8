"""What the multiturn suite reads around a front's run: the engines' tokenizer and decode's prompt tokens by
source, and from each kvpush router its routes (/debug/timings) and its bypass-prediction counters (/metrics)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import httpx

from loadtest import multiturn, promtext
from loadtest.bench.point import kv_sources, scrape
from stack.engines import Engine


def words_per_token(prefill_url: str) -> float:
    """Measured on the engine's own tokenizer: words of message_text per token."""
    sample = multiturn.message_text(400, "user", 1, 1.0)
    resp = httpx.post(
        f"{prefill_url}/tokenize", json={"model": "tiny", "prompt": sample, "add_special_tokens": False}, timeout=30
    )
    resp.raise_for_status()
    return len(sample.split()) / max(1, len(resp.json()["tokens"]))


def reset_caches(engines: list[Engine]) -> None:
    for engine in engines:
        httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30).raise_for_status()


def decode_sources(decodes: list[Engine]) -> dict[str, float]:
    total: dict[str, float] = {}
    for engine in decodes:
        for k, v in kv_sources({}, scrape(engine.url)).items():
            total[k] = total.get(k, 0.0) + v
    return total


def summed_counts(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def grown(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """What a router's counters gained between two scrapes (None when either scrape had none)."""
    if before is None or after is None:
        return after if before is None else None
    return {k: after[k] - before.get(k, 0) for k in after}


def routes(router_url: str, prefix: str = "") -> dict[str, int]:
    """How the kvpush router served the requests whose id starts with `prefix` (its /debug/timings records by
    mode: push, bypass, ...)."""
    try:
        records = httpx.get(f"{router_url}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no route counts from {router_url}: {error}")
        return {}
    out: dict[str, int] = {}
    for record in records:
        if str(record.get("request_id", "")).startswith(prefix):
            out[str(record.get("mode"))] = out.get(str(record.get("mode")), 0) + 1
    return out


def accuracy(bases: Sequence[str]) -> dict[str, int] | None:
    """The bypass counters summed over a front's routers (None when one has none)."""
    found = [scrape_bypass_accuracy(base) for base in bases]
    if any(f is None for f in found):
        return None
    return summed_counts(f for f in found if f is not None)


def scrape_bypass_accuracy(router_url: str) -> dict[str, int] | None:
    """The kvpush router's bypass-prediction counters now (its /metrics); None when it has none or is gone."""
    try:
        return bypass_accuracy(scrape(router_url))
    except httpx.HTTPError as error:
        print(f"multiturn: no bypass accuracy from {router_url}: {error}")
        return None


def bypass_accuracy(samples: Mapping[promtext.Sample, float]) -> dict[str, int] | None:
    """{"checked", "accurate"} from kvpush_bypass_checked / kvpush_bypass_accurate (counters: exported with a
    `_total` suffix), and {"predicted_cached", "actual_cached"} (the checked bypasses' summed cached tokens, as
    predicted and as decode reported them) where the router exports them; None when it exports neither of the
    first two (it runs no decider)."""
    names = {name for name, _ in samples}
    counts: dict[str, int] = {}
    for key, metric in (*((k, k) for k in ("checked", "accurate")), *_CACHED):
        found = [n for n in (f"kvpush_bypass_{metric}_total", f"kvpush_bypass_{metric}") if n in names]
        if found:
            counts[key] = int(promtext.total(samples, found[0]))
        elif key in ("checked", "accurate"):
            return None
    return counts


_CACHED = (("predicted_cached", "predicted_cached_tokens"), ("actual_cached", "actual_cached_tokens"))
