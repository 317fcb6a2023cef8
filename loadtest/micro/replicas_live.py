"""Live check of multi-turn reuse across router replicas (issue 40): ``python -m loadtest.micro.replicas_live``.

Against a running ``kvpush stack --replicas 2`` (or any routers in front of the same engines): four-turn chat
conversations, each with its own ~300-word system prompt and an ``X-Session-ID``, greedy 32-token answers,
non-streamed. Pass ``alternate``: turn n of conversation c goes to replica (c + n) mod 2, as a load balancer in
front of several replicas may send it. Pass ``one``: the same conversations' shapes (same seed, same lengths,
another word in the system prompt's first line, so nothing is cached from the first pass) all through the first replica:
the rate one router reaches on the same plan. Each turn's route is read from the replica's ``/debug/timings``.
Prints one JSON line per turn, then a JSON summary: later turns decode-only per pass and per replica.

    flock /tmp/kvpush-vllm.lock timeout 900 bash -c 'kvpush stack --replicas 2 & ...'   # see bench/ANALYSIS.md
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

WORDS = ("the a river stone light garden quiet number paper window morning build carry simple north table").split()  # noqa: SIM905
TURNS = 4
PASS_WORD = {"alternate": "river", "one": "stone"}  # one token each: both passes' prompts have the same lengths


@dataclass(frozen=True)
class LiveTurn:
    conversation: int
    turn: int
    replica: int
    mode: str | None
    prompt_tokens: int | None
    cached_tokens: int | None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(
    client: httpx.Client, bases: list[str], c: int, tag: str, alternate: bool, timeout_s: float
) -> list[LiveTurn]:
    """One conversation of TURNS turns; the words depend on `c` only, the system prompt's name on `tag`."""
    rng = random.Random(40_000 + c)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are the {PASS_WORD[tag]} assistant {chr(65 + c % 26)}. " + _words(rng, 300)}
    ]
    sid = f"live-{tag}-{int(time.time())}-{c}"
    out = []
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user", "content": f"Question {turn}: " + _words(rng, rng.randrange(20, 60))})
        replica = (c + turn) % len(bases) if alternate else 0
        rid = f"{sid}-t{turn}"
        body = {"model": "tiny", "messages": messages, "max_tokens": 32, "temperature": 0}
        headers = {"X-Session-ID": sid, "x-request-id": rid}
        resp = client.post(f"{bases[replica]}/v1/chat/completions", headers=headers, json=body, timeout=timeout_s)
        resp.raise_for_status()
        answer = resp.json()
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        timings = client.get(f"{bases[replica]}/debug/timings", params={"request_id": rid}, timeout=timeout_s)
        records = timings.json()["requests"]
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        mode = records[0]["mode"] if records else None
        out.append(LiveTurn(c, turn, replica, mode, usage.get("prompt_tokens"), cached))
        print(json.dumps(out[-1].__dict__), flush=True)
    return out


def summary(turns: list[LiveTurn], replicas: int) -> dict[str, Any]:
    later = [t for t in turns if t.turn > 1]
    out: dict[str, Any] = {
        "later_bypassed": sum(t.mode == "bypass" for t in later),
        "later": len(later),
        "first_bypassed": sum(t.mode == "bypass" for t in turns if t.turn == 1),
    }
    for r in range(replicas):
        mine = [t for t in later if t.replica == r]
        out[f"replica{r}"] = f"{sum(t.mode == 'bypass' for t in mine)} of {len(mine)}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", default="18400,18401", help="the replicas' ports on 127.0.0.1")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--passes", default="alternate,one", help="alternate and/or one (comma-separated)")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    bases = [f"http://127.0.0.1:{int(p)}" for p in args.ports.split(",")]
    report: dict[str, Any] = {}
    with httpx.Client() as client:
        for name in args.passes.split(","):
            if name not in PASS_WORD:
                parser.error(f"unknown pass {name!r} (known: {', '.join(PASS_WORD)})")
            alternate = name == "alternate"
            convs = range(args.conversations)
            turns = [t for c in convs for t in conversation(client, bases, c, name, alternate, args.timeout_s)]
            report[name] = summary(turns, len(bases) if alternate else 1)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
