"""What the router's exact prompt ids cost per request (issue 40 item 1), on the conversations the multiturn suite
sends: a ~300-token system prompt, user messages and answers of ~60 tokens each, chat bodies and their
completions transcripts (loadtest/multiturn.py). One router's encoder (router/deciders/prompt_tokens.py) follows
`conversations` conversations turn by turn; at ~1k, ~4k and ~16k prompt tokens the CPU time of a next turn's ids
(earlier turns remembered) is taken, with the same request's ids on a fresh encoder beside it (nothing
remembered: what a new conversation's first turn, or a router without the memo, pays). Median over the
conversations, CPU time of this process.

    .venv/bin/python -m loadtest.bench.suites.multiturn.idcost [--model .cache/kvpush/models/tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from loadtest import multiturn
from router.deciders.prompt_tokens import PromptTokens
from router.domain import Endpoint

SIZES = (1000, 4000, 16000)


def _cpu(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    out = call()
    return out, (time.process_time() - start) * 1000.0


def conversation(tokens: PromptTokens, api: str, seed: int, model: Path) -> dict[int, dict[str, float]]:
    """One conversation grown past the largest size; at the first turn past each size, its figures (ms): the
    next turn's ids on `tokens` (the conversation's earlier turns seen), and the same request's ids on a fresh
    encoder (nothing remembered: a new conversation's first turn, or a router without the memo)."""
    system = multiturn.message_text(300, "system", seed, 0.75)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    found: dict[int, dict[str, float]] = {}
    turn = 0
    while len(found) < len(SIZES):
        turn += 1
        messages.append({"role": "user", "content": multiturn.message_text(60, "user", seed * 1000 + turn, 0.75)})
        path, body = multiturn.turn_request(api, "m", messages, 8)
        endpoint = Endpoint.CHAT if path.endswith("chat/completions") else Endpoint.COMPLETIONS
        ids, next_ms = _cpu(partial(tokens.of, endpoint, body))
        assert ids is not None
        size = next((s for s in SIZES if len(ids) >= s and s not in found), None)
        if size is not None:
            _, fresh_ms = _cpu(partial(PromptTokens.load(str(model)).of, endpoint, body))
            found[size] = {"tokens": len(ids), "next_turn_ms": next_ms, "nothing_remembered_ms": fresh_ms}
        messages.append({"role": "assistant", "content": multiturn.message_text(60, "answer", seed * 7 + turn, 0.75)})
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path(".cache/kvpush/models/tiny"))
    p.add_argument("--conversations", type=int, default=5)
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    for api in ("chat", "completions"):
        tokens = PromptTokens.load(str(args.model))
        runs = [conversation(tokens, api, seed, args.model) for seed in range(1, args.conversations + 1)]
        out[api] = {
            size: {
                k: round(statistics.median(r[size][k] for r in runs), 3)
                for k in ("tokens", "next_turn_ms", "nothing_remembered_ms")
            }
            for size in SIZES
        }
        out[api]["extended"] = tokens.extended
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
