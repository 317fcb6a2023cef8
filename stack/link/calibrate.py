"""Resolve a preset from the run's own prefill: time a few prompts on P, then set the link's rate (live).

`calibrate()` sends `warmup + runs` completions of `prompt_tokens` fresh token ids (no prefix-cache hit) with
`max_tokens=1` straight to a prefill engine (no KV transfer), takes the median time as the prefill time,
resolves the preset with the prompt's KV bytes and applies the shaping with `Link.shape` (no restart). The
returned `LinkPlan.record()` is what a row carries; the measured times are in `Calibration.prefill_times_s`.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import statistics
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stack.link.plan import LinkPlan, Preset, Shaping, resolve

__all__ = ["Calibration", "calibrate", "prompt_ids", "timed_prefill"]

FIRST_ID, LAST_ID = 300, 2000  # ordinary tokens of the tiny models' vocabularies (2048): no byte or special ids
REQUEST_TIMEOUT_S = 120.0


class _Shapeable(Protocol):
    def shape(self, shaping: Shaping | None) -> None: ...


@dataclasses.dataclass(frozen=True)
class Calibration:
    plan: LinkPlan
    prefill_times_s: tuple[float, ...]

    def record(self) -> dict[str, Any]:
        return {**self.plan.record(), "link_prefill_times_s": [round(t, 6) for t in self.prefill_times_s]}


def prompt_ids(tokens: int, seed: int) -> list[int]:
    """`tokens` token ids drawn from `seed`: a different seed shares no prefix (no prefix-cache hit)."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(tokens)]


def timed_prefill(url: str, model: str, ids: Sequence[int], timeout: float = REQUEST_TIMEOUT_S) -> float:
    """Seconds for one `max_tokens=1` completion of `ids` at `url` (raises OSError/RuntimeError on failure)."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0})
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        start = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        seconds = time.monotonic() - start
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"prefill probe to {url}: HTTP {response.status}: {payload[:300]!r}")
    return seconds


def calibrate(
    link: _Shapeable,
    chosen: Preset,
    prefill_url: str,
    *,
    prompt_tokens: int,
    kv_bytes_per_token: int,
    model: str = "tiny",
    runs: int = 3,
    warmup: int = 1,
    probe: Callable[[str, str, Sequence[int]], float] = timed_prefill,
    seed: int | None = None,
) -> Calibration:
    """Measure P's prefill for `prompt_tokens` (median of `runs` after `warmup`), resolve `chosen`, shape."""
    if runs < 1 or prompt_tokens < 1:
        raise ValueError("need at least one run of at least one token")
    base = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    times = [probe(prefill_url, model, prompt_ids(prompt_tokens, base + i)) for i in range(warmup + runs)][warmup:]
    plan = resolve(chosen, prefill_s=statistics.median(times), kv_bytes=prompt_tokens * kv_bytes_per_token)
    link.shape(plan.shaping)
    return Calibration(plan, tuple(times))
