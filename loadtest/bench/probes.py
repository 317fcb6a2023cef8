"""Probes of a front door at start-up: does it send decode's leg while prefill is still running?"""

import threading
import time
from typing import Any

import httpx

from loadtest import promtext


def _load(base_url: str, client: httpx.Client) -> float:
    """Requests running + waiting on a vLLM engine (waiting includes those waiting for remote KV)."""
    samples = promtext.parse(client.get(base_url.rstrip("/") + "/metrics", timeout=5.0).text)
    return promtext.total(samples, "vllm:num_requests_running") + promtext.total(samples, "vllm:num_requests_waiting")


def concurrency_probe(
    front: str, p_url: str, d_url: str, prompt_tokens: int = 1500, polls: int = 2000
) -> dict[str, Any]:
    """Does `front` send D's leg while P is still prefilling? Seen from the engines, not from the front.

    Two short requests first (vllm-router learns a push prefill's identity from its first answer). Then P's
    prefill time of a long prompt, measured directly on P; then the same length through the front while only
    D's /metrics is polled: `d_seen_ms` is when D first holds the request (running or waiting, which includes
    waiting for remote KV). A sequential front cannot show it before P's prefill is done, so "concurrent" is
    d_seen_ms < 0.75 x P's prefill time (D's own tokenization and the polls take some of it). Prompts start
    with distinct words, so no prefix cache helps.
    """
    out: dict[str, Any] = {}
    with httpx.Client(timeout=120.0) as c:
        model = c.get(front.rstrip("/") + "/v1/models").json()["data"][0]["id"]
        sample = "hello " * 100
        count = c.post(p_url.rstrip("/") + "/tokenize", json={"model": model, "prompt": sample}).json()["count"]
        words = max(int(prompt_tokens * 100 / max(int(count), 1)) - 8, 16)

        def body(tag: str, n: int, max_tokens: int) -> dict[str, Any]:
            return {"model": model, "prompt": f"{tag} " + "hello " * n, "max_tokens": max_tokens}

        for i in range(2):
            c.post(front.rstrip("/") + "/v1/completions", json=body(f"warm{i}-{time.time_ns()}", 16, 2))
        t = time.monotonic()
        r = c.post(p_url.rstrip("/") + "/v1/completions", json=body(f"direct-{time.time_ns()}", words, 1))
        out["p_prefill_ms"] = 1000 * (time.monotonic() - t)
        if r.status_code != 200:
            return out | {"concurrent": False, "error": f"direct prefill: {r.status_code} {r.text[:200]}"}

    def send() -> None:
        with httpx.Client(timeout=120.0) as c:
            r = c.post(front.rstrip("/") + "/v1/completions", json=body(f"probe-{time.time_ns()}", words, 2))
            out["status"] = r.status_code

    worker = threading.Thread(target=send, daemon=True)
    with httpx.Client() as client:
        t0 = time.monotonic()
        worker.start()
        for _ in range(polls):
            if _load(d_url, client) > 0:
                out["d_seen_ms"] = 1000 * (time.monotonic() - t0)
                break
            if not worker.is_alive():
                break
    worker.join(timeout=120.0)
    seen = out.get("d_seen_ms")
    out["concurrent"] = out.get("status") == 200 and seen is not None and seen < 0.75 * out["p_prefill_ms"]
    return out
