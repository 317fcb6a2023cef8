"""Multi-turn sessions: the plan (pure, seeded: the same sessions and arrival times for every front), one streamed
turn, a whole run of sessions against one base URL, and the per-turn figures.

A session starts at a Poisson arrival time, then runs its turns one after the other: each turn appends a new user
message (even turns read like a user reply, odd ones like a pasted tool result; both go as role "user", which any
chat template accepts) to the history, streams the answer greedily at a fixed length, appends the answer exactly
as received, and waits its think time before the next turn. Every turn carries the session's `X-Session-ID`.

Against several targets (router replicas in front of the same engines) every turn goes to another replica than
the turn before: turn n of the i-th session to replica (i + n - 1) mod k (`turn_target`), so no replica sees two
turns of a conversation in a row and each starts its share of the conversations (with two replicas, half the
sessions go A B A B and half B A B A).

A session speaks chat (`/v1/chat/completions`, the history as messages) or completions (`/v1/completions`, the
history as one transcript text, `transcript`); with `api="both"` even sessions speak chat and odd ones
completions. With `burst` > 1 sessions arrive in groups of that many at the same instant (the group's Poisson time).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.arrivals import ArrivalSpec, schedule
from loadtest.client import Clock, send
from loadtest.records import ClientRecord
from loadtest.stats import dist_ms

SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True)
class SessionShape:
    sessions: int
    session_rate: float  # sessions started per second (Poisson)
    turns: tuple[int, int] = (6, 10)  # inclusive range per session
    message_tokens: tuple[int, int] = (50, 500)
    answer_tokens: tuple[int, int] = (32, 128)
    think_s: float = 2.0  # mean think time between turns (exponential)
    system_tokens: int = 0  # a per-session system prompt (0: none)
    seed: int = 0
    system_shared: bool = False  # every session opens with the same system prompt (else each its own)
    api: str = "chat"  # "chat" | "completions" | "both" (even sessions chat, odd ones completions)
    burst: int = 1  # sessions arrive in groups of this many at once

    def __post_init__(self) -> None:
        if self.api not in (*APIS, "both") or self.burst < 1:
            raise ValueError(f"session shape: api chat, completions or both, burst >= 1 ({self.api!r}, {self.burst})")


APIS = ("chat", "completions")


@dataclass(frozen=True)
class TurnSpec:
    message_tokens: int
    answer_tokens: int
    think_s: float  # wait after this turn's answer before the next turn
    kind: str  # "user" | "tool" (what the text reads like)
    seed: int


@dataclass(frozen=True)
class Session:
    id: str
    start_s: float
    system_tokens: int
    turns: tuple[TurnSpec, ...]
    system_seed: int | None = None  # the system prompt's text seed; None: the session id's
    api: str = "chat"  # "chat" | "completions"


def plan_sessions(shape: SessionShape) -> list[Session]:
    """The sessions of a run, fully determined by `shape` (seed included)."""
    rng = random.Random(shape.seed)
    starts = schedule(ArrivalSpec(shape.session_rate, 1.0, shape.seed), shape.sessions)
    starts = [starts[i - i % shape.burst] for i in range(len(starts))]  # a group starts at its first's time
    out = []
    for i, start in enumerate(starts):
        turns = tuple(
            TurnSpec(
                message_tokens=rng.randint(*shape.message_tokens),
                answer_tokens=rng.randint(*shape.answer_tokens),
                think_s=rng.expovariate(1.0 / shape.think_s) if shape.think_s > 0 else 0.0,
                kind="user" if t % 2 == 0 else "tool",
                seed=rng.getrandbits(32),
            )
            for t in range(rng.randint(*shape.turns))
        )
        shared = shape.seed if shape.system_shared else None
        api = shape.api if shape.api != "both" else APIS[i % 2]
        out.append(Session(f"{session_prefix(shape.seed)}{i:04d}", start, shape.system_tokens, turns, shared, api))
    return out


def session_prefix(seed: int) -> str:
    """What every session id (and so every request id) of the sessions planned with `seed` starts with."""
    return f"mt-{seed}-"


def message_text(tokens: int, kind: str, seed: int, words_per_token: float) -> str:
    """About `tokens` tokens of text (words from a small vocabulary; `words_per_token` measured on the server)."""
    rng = random.Random(seed)
    words = max(1, round(tokens * words_per_token))
    head = f"[{kind} {seed:08x}]"  # unique per turn: no accidental sharing between sessions
    body = " ".join(_VOCAB[rng.randrange(len(_VOCAB))] for _ in range(words))
    return f"{head} {body}" if kind == "user" else f"{head} result:\n{body}"


_WORDS = (
    "the cache key value block prefix decode prefill router token model turn answer agent tool call result session "
    "time load queue batch write read push pull node port step plan code test data file line list table index memory "
    "layer head page user reply note check run fast slow next last first more less"
)
_VOCAB = tuple(_WORDS.split())


@dataclass
class TurnRecord:
    """One turn as the client saw it: the request record plus what multi-turn needs."""

    session: str
    turn: int  # 1-based
    rec: ClientRecord
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the engine reports it
    answer: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"session": self.session, "turn": self.turn, "cached_tokens": self.cached_tokens}
        out.update(self.rec.to_json())
        out["answer"] = self.answer
        return out


class _Answer:
    """What multi-turn reads from a turn's SSE lines besides the timing: the answer text and cached tokens."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.cached: int | None = None

    def feed(self, line: str) -> None:
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            return
        event = json.loads(line[5:])
        for choice in event.get("choices") or ():  # chat: the delta's content; completions: the text
            self.pieces.append(str((choice.get("delta") or {}).get("content") or choice.get("text") or ""))
        details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            self.cached = details["cached_tokens"]


async def send_turn(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: Mapping[str, str],
    rec: ClientRecord,
    clock: Clock,
    timeout_s: float,
    expect_output: int,
) -> tuple[ClientRecord, str, int | None]:
    """POST one streamed chat turn (client.send, reading the answer too); failures land in `rec.error`."""
    got = _Answer()
    rec = await send(client, url, body, rec, clock, timeout_s, expect_output, headers=headers, listen=got.feed)
    return rec, "".join(got.pieces), got.cached


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    words_per_token: float
    timeout_s: float = 300.0


def turn_target(targets: Sequence[Target], session_index: int, turn: int) -> Target:
    """Where turn `turn` (1-based) of the `session_index`-th session goes: the next replica each turn."""
    return targets[(session_index + turn - 1) % len(targets)]


async def run_sessions(
    target: Target | Sequence[Target], sessions: Sequence[Session], clock: Clock = time.monotonic
) -> tuple[list[TurnRecord], float]:
    """Every session on its own schedule, each turn on `turn_target` of the targets (one target: all of them);
    returns the turn records (session, then turn order) and the duration."""
    targets = (target,) if isinstance(target, Target) else tuple(target)
    if not targets:
        raise ValueError("run_sessions: no target")
    limits = httpx.Limits(max_connections=max(64, len(sessions)), max_keepalive_connections=max(64, len(sessions)))
    t0 = clock()
    timeout = httpx.Timeout(max(t.timeout_s for t in targets), connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        done = await asyncio.gather(*(_session(client, targets, i, s, t0, clock) for i, s in enumerate(sessions)))
    return [r for turns in done for r in turns], clock() - t0


async def _session(
    client: httpx.AsyncClient, targets: Sequence[Target], index: int, session: Session, t0: float, clock: Clock
) -> list[TurnRecord]:
    target = targets[0]  # the history's text is the same on every target (one model, one words_per_token)
    await asyncio.sleep(max(0.0, t0 + session.start_s - clock()))
    messages: list[dict[str, str]] = []
    if session.system_tokens:
        seed = zlib.crc32(session.id.encode()) if session.system_seed is None else session.system_seed
        text = message_text(session.system_tokens, "system", seed, target.words_per_token)
        messages.append({"role": "system", "content": text})
    out: list[TurnRecord] = []
    for n, spec in enumerate(session.turns, start=1):
        messages.append(
            {"role": "user", "content": message_text(spec.message_tokens, spec.kind, spec.seed, target.words_per_token)}
        )
        path, body = turn_request(session.api, target.model, messages, spec.answer_tokens)
        where = turn_target(targets, index, n)
        url = where.base_url.rstrip("/") + path
        rec = ClientRecord(index=len(out), request_id=f"{session.id}-t{n}", sent=clock() - t0)
        headers = {SESSION_HEADER: session.id, "x-request-id": rec.request_id}
        rec, answer, cached = await send_turn(
            client, url, body, headers, rec, clock, where.timeout_s, spec.answer_tokens
        )
        out.append(TurnRecord(session.id, n, rec, cached, answer))
        if not rec.ok:
            break  # the history is broken: the rest of the session would not be the same conversation
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(spec.think_s)
    return out


def turn_request(
    api: str, model: str, messages: Sequence[Mapping[str, str]], answer_tokens: int
) -> tuple[str, dict[str, Any]]:
    """A turn's path and body: chat sends the messages, completions their transcript."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": answer_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "completions":
        return "/v1/completions", {**body, "prompt": transcript(messages)}
    return "/v1/chat/completions", {**body, "messages": [dict(m) for m in messages]}


def transcript(messages: Sequence[Mapping[str, str]]) -> str:
    """A completions prompt holding a conversation: each message as `Role: text` then a blank line, ending on
    the assistant's cue; an answer follows its cue as received (no space added), so the next turn's prompt is
    this one, the answer and the new message: the text a client continuing a completion sends."""
    parts = [f"{m['role'].capitalize()}:{'' if m['role'] == 'assistant' else ' '}{m['content']}" for m in messages]
    return "\n\n".join([*parts, "Assistant:"])


def by_turn(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """TTFT per turn index, TTFT over turns >= 2, TPOT, and the tokens an ideal router could have reused."""
    ok = [r for r in records if r.rec.ok]
    turns = sorted({r.turn for r in ok})
    ttft = {str(t): dist_ms([r.rec.ttft_s for r in ok if r.turn == t and r.rec.ttft_s is not None]) for t in turns}
    later = [r.rec.ttft_s for r in ok if r.turn >= 2 and r.rec.ttft_s is not None]
    return {
        "ttft_ms_by_turn": ttft,
        "ttft_ms_turn2plus": dist_ms(later),
        "ttft_ms_turn1": dist_ms([r.rec.ttft_s for r in ok if r.turn == 1 and r.rec.ttft_s is not None]),
        "tpot_ms_all": dist_ms([t for r in ok if (t := r.rec.tpot_s) is not None]),
        "ideal_reusable_tokens": ideal_reusable(records),
        "turns_ok": len(ok),
        "turns_failed": len(records) - len(ok),
    }


def ideal_reusable(records: Sequence[TurnRecord]) -> int:
    """Per turn >= 2: the previous turn's prompt and answer (an ideal router's decode holds them), capped at the
    turn's own prompt; summed."""
    total = 0
    previous: dict[str, TurnRecord] = {}
    for r in sorted(records, key=lambda x: (x.session, x.turn)):
        before = previous.get(r.session)
        if before is not None and r.rec.ok and before.rec.ok:
            held = (before.rec.prompt_tokens or 0) + (before.rec.output_tokens or 0)
            total += min(held, r.rec.prompt_tokens or 0)
        previous[r.session] = r
    return total


def answers_agree(a: Sequence[TurnRecord], b: Sequence[TurnRecord]) -> tuple[int, int]:
    """(equal, compared): turns both runs completed whose answers are identical (greedy: they must be)."""
    theirs = {(r.session, r.turn): r.answer for r in b if r.rec.ok}
    pairs = [(r.answer, theirs[(r.session, r.turn)]) for r in a if r.rec.ok and (r.session, r.turn) in theirs]
    return sum(x == y for x, y in pairs), len(pairs)


def write_turns(path: Path, records: Sequence[TurnRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def shape_json(shape: SessionShape) -> dict[str, Any]:
    return asdict(shape)
