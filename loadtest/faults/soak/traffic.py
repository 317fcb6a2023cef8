"""The soak's clients: a seeded mix of request kinds, each with the outcomes it may end with.

Kinds: completions and chat, streamed and not; a multi-turn chat session (three turns, each resending the whole
conversation, so the engines' prefix caches and the router's session state are exercised); a client that leaves
after a few stream events; a bad request (the router or the engine must refuse it with a 4xx and an OpenAI-style
error). Arrivals are Poisson at the soak's rate; each job runs on its own thread (bounded pool), so a slow answer
never delays the next arrival."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

GUARD = 200.0  # one request's hang guard: longer than every default leg deadline
MODEL = "tiny"
# kind -> weight in the mix (a session is three requests)
MIX: dict[str, float] = {
    "completion-stream": 3,
    "completion-json": 2,
    "chat-stream": 3,
    "chat-json": 2,
    "session": 1,
    "leaver": 1,
    "bad": 1,
}
SYSTEMS = tuple(f"You are assistant {i}. " + " ".join(f"rule {j}: be brief." for j in range(30)) for i in range(4))


@dataclass(frozen=True)
class SoakOutcome:
    kind: str
    label: str  # "200", "200 cut", "400", "left", "no answer", ...
    expected: bool
    seconds: float


def _prompt(rng: random.Random, least: int = 20, most: int = 120) -> str:
    """A prompt no engine has seen (a unique first line), of `least` to `most` short lines of code."""
    words = rng.randint(least, most)
    return f"# {uuid.uuid4().hex}\n" + " ".join(f"def f{i}(x): return x * {i}" for i in range(words))


def _read(response: httpx.Response, stream: bool) -> tuple[str, str]:
    """(label, assistant text) of a finished response."""
    if response.status_code != 200:
        return str(response.status_code), ""
    if not stream:
        data = response.json()
        choice = data["choices"][0]
        return "200", str(choice.get("text") or (choice.get("message") or {}).get("content") or "")
    text, done, error = "", False, False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                error = True
                continue
            for choice in event.get("choices", []):
                text += str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return ("200" if done and not error else "200 cut"), text


def _post(http: httpx.Client, url: str, path: str, payload: dict[str, Any]) -> tuple[str, str]:
    stream = bool(payload.get("stream"))
    try:
        with http.stream("POST", f"{url}{path}", json=payload, timeout=GUARD) as response:
            if not stream or response.status_code != 200:
                response.read()
            return _read(response, stream)
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "no answer", ""


def completion(http: httpx.Client, url: str, rng: random.Random, stream: bool) -> str:
    payload = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": rng.randint(8, 48), "stream": stream}
    return _post(http, url, "/v1/completions", payload)[0]


def chat(http: httpx.Client, url: str, rng: random.Random, stream: bool) -> str:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": _prompt(rng)}]
    payload = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(8, 48), "stream": stream}
    return _post(http, url, "/v1/chat/completions", payload)[0]


def session(http: httpx.Client, url: str, rng: random.Random) -> str:
    """Three turns; the label is the first turn's that was not 200 (else "200"). Short turns: the whole
    conversation stays within the bed's 2048-token context."""
    messages: list[dict[str, str]] = [{"role": "system", "content": rng.choice(SYSTEMS)}]
    for turn in range(3):
        messages.append({"role": "user", "content": _prompt(rng, 8, 24)})
        payload = {"model": MODEL, "messages": messages, "max_tokens": 24, "stream": turn % 2 == 1}
        label, text = _post(http, url, "/v1/chat/completions", payload)
        if label != "200":
            return label
        messages.append({"role": "assistant", "content": text})
    return "200"


def leaver(url: str, rng: random.Random, events: int = 3) -> str:
    """A stream read for `events` events, then the socket closed: "left" once it had its events."""
    raw = json.dumps({"model": MODEL, "prompt": _prompt(rng), "max_tokens": 64, "stream": True}).encode()
    parts = urlsplit(url)
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=GUARD) as sock:
            sock.sendall(head + raw)
            seen = b""
            while seen.count(b"data: ") < events:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                seen += chunk
    except OSError:
        return "no answer"
    if not seen.startswith(b"HTTP/1.1 200"):
        return seen.split(b" ", 2)[1].decode(errors="replace") if seen.startswith(b"HTTP/") else "no answer"
    return "left" if seen.count(b"data: ") >= events else "200 cut"


BAD_BODIES: tuple[bytes, ...] = (
    b'{"model": "tiny", "prompt": "x", "max_tokens": -5}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 4',  # not JSON
    b'{"model": "tiny", "max_tokens": 4}',  # no prompt
    b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "n": 0}',
)


def bad(http: httpx.Client, url: str, rng: random.Random) -> str:
    body = rng.choice(BAD_BODIES)
    try:
        r = http.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError:
        return "no answer"
    try:
        clear = isinstance(r.json().get("error"), dict)
    except ValueError:
        clear = False
    return f"{r.status_code}" + ("" if clear else " unclear")


def expected(kind: str, label: str) -> bool:
    """Pure: the outcomes a kind may end with. Everything else is an unexpected outcome (the soak fails on it)."""
    if kind == "bad":
        return label.isdigit() and 400 <= int(label) < 500 and label != "429"
    if kind == "leaver":
        return label == "left"
    return label == "200"


def run_one(kind: str, url: str, rng: random.Random) -> SoakOutcome:
    t0 = time.monotonic()
    with httpx.Client(timeout=GUARD) as http:
        jobs: dict[str, Callable[[], str]] = {
            "completion-stream": lambda: completion(http, url, rng, True),
            "completion-json": lambda: completion(http, url, rng, False),
            "chat-stream": lambda: chat(http, url, rng, True),
            "chat-json": lambda: chat(http, url, rng, False),
            "session": lambda: session(http, url, rng),
            "leaver": lambda: leaver(url, rng),
            "bad": lambda: bad(http, url, rng),
        }
        label = jobs[kind]()
    return SoakOutcome(kind, label, expected(kind, label), time.monotonic() - t0)


@dataclass
class Outcomes:
    """Every outcome so far (thread-safe)."""

    outcomes: list[SoakOutcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: SoakOutcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def counts(self) -> dict[str, dict[str, int]]:
        with self.lock:
            done = list(self.outcomes)
        per: dict[str, Counter[str]] = {}
        for o in done:
            per.setdefault(o.kind, Counter())[o.label] += 1
        return {k: dict(sorted(c.items())) for k, c in sorted(per.items())}

    def unexpected(self) -> dict[str, int]:
        with self.lock:
            return dict(Counter(o.kind for o in self.outcomes if not o.expected))


def _record(tally: Outcomes, kind: str, url: str, rng: random.Random) -> None:
    tally.add(run_one(kind, url, rng))


def closed_loop(url: str, clients: int, seconds: float, seed: int) -> float:
    """Capacity: `clients` back-to-back clients of the mix for `seconds`; jobs finished per second."""
    until = time.monotonic() + seconds
    kinds, weights = list(MIX), list(MIX.values())

    def loop(i: int) -> int:
        rng, n = random.Random(seed * 1000 + i), 0
        while time.monotonic() < until:
            run_one(rng.choices(kinds, weights)[0], url, rng)
            n += 1
        return n

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(loop, range(clients)))
    return done / (time.monotonic() - t0)


def open_loop(url: str, rate: float, until: float, seed: int, tally: Outcomes, max_threads: int = 64) -> int:
    """Poisson arrivals of the mix at `rate` jobs/s until `until` (monotonic); returns the arrivals. Waits for
    every job to finish."""
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    arrivals = 0
    with ThreadPoolExecutor(max_threads) as pool:
        t = time.monotonic()
        while t < until:
            time.sleep(max(0.0, t - time.monotonic()))
            job_rng = random.Random(rng.getrandbits(64))
            kind = rng.choices(kinds, weights)[0]
            pool.submit(_record, tally, kind, url, job_rng)
            arrivals += 1
            t += rng.expovariate(rate)
    return arrivals
