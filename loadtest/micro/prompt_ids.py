"""What it costs a router to know a chat prompt's token ids (issue 24, the KV-event deciders): a one-off
measurement behind router/README.md's "KV events" choice, on the tiny model and one real vLLM CPU engine.

For a conversation of `turns` turns (about `chars` characters):
- in the router: the chat template rendered and tokenized with the model's own tokenizer (transformers; what a
  router-side tokenizer would do per request);
- a worker's POST /tokenize (the same messages; one HTTP round trip to a vLLM CPU engine on the other core);
- from the KV events: the session's blocks held per worker (`KvEventView.session_tokens`), on an index holding
  `blocks` blocks for the session on each of 4 workers.

    flock /tmp/kvpush-vllm.lock .venv/bin/python -m loadtest.micro.prompt_ids
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.procs import vllm_lock
from router.kv_events.frames import Stored
from router.kv_events.index import KvIndex
from router.kv_events.stream import StreamStatus
from router.kv_events.view import KvEventView
from stack.engines import EngineSpec, Fleet
from stack.tiny_model import build

CACHE = Path(".cache/kvpush")


def conversation(turns: int, chars: int) -> list[dict[str, str]]:
    per = max(1, chars // (2 * turns))
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: " + "def f(x): return x * 2\n" * (per // 23)})
        messages.append({"role": "assistant", "content": f"answer {i}: " + "the value doubles. " * (per // 19)})
    return [*messages, {"role": "user", "content": "and then?"}]


def timed(call: Callable[[], Any], n: int) -> tuple[float, Any]:
    """Median seconds of `n` calls (after one warm-up) and the last result."""
    result = call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        result = call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result


def events_lookup(blocks: int) -> Callable[[], dict[str, int]]:
    index = KvIndex(200_000)
    for w in range(4):
        hashes = tuple(range(1, blocks + 1))
        event = Stored(hashes, None, tuple(range(blocks * 16)), 16, None, None, False, "s" if w == 0 else "t")
        index.stream(f"d{w}", 0).apply([event])
    view = KvEventView(index, lambda worker: [StreamStatus(worker, 0, "in_sync", True, True, 0, blocks, blocks)])
    return lambda: view.session_tokens("s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--chars", type=int, default=8000)
    p.add_argument("-n", type=int, default=50)
    args = p.parse_args()
    model = build(CACHE / "models" / "tiny", "tiny")
    messages = conversation(args.turns, args.chars)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def render_and_tokenize() -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    local_s, ids = timed(render_and_tokenize, args.n)
    out: dict[str, Any] = {"chars": sum(len(m["content"]) for m in messages), "prompt_tokens": len(ids)}
    out["router_tokenizer_ms"] = round(local_s * 1000, 3)
    events_s, _ = timed(events_lookup(len(ids) // 16), args.n * 20)
    out["events_session_lookup_us"] = round(events_s * 1e6, 2)
    spec = EngineSpec(name="prompt-ids", role="single", model=model, core=1)
    with vllm_lock(), Fleet(CACHE / "logs") as fleet:
        (engine,) = fleet.start_all([spec])
        fleet.wait_all_healthy(300)
        body = {"model": "tiny", "messages": messages}
        with httpx.Client(base_url=engine.url, timeout=30) as client:
            remote_s, answer = timed(lambda: client.post("/tokenize", json=body).json(), args.n)
    out["worker_tokenize_ms"] = round(remote_s * 1000, 3)
    out["worker_tokenize_tokens"] = answer.get("count")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
