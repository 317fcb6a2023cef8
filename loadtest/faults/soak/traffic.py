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
from dataclasses import asdict, dataclass, field, replace
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
    began_s: float = 0.0  # since the soak's start
    detail: str = ""  # an unexpected outcome's why, with its x-request-id (``SoakAnswer.detail``)


def _prompt(rng: random.Random, least: int = 20, most: int = 120) -> str:
    """A prompt no engine has seen (a unique first line), of `least` to `most` short lines of code."""
    words = rng.randint(least, most)
    return f"# {uuid.uuid4().hex}\n" + " ".join(f"def f{i}(x): return x * {i}" for i in range(words))


@dataclass(frozen=True)
class SoakAnswer:
    """What one request ended with: its label, the assistant's text, and for anything but a clean answer why (the
    exception or the cut, with the x-request-id the soak sent, which the router and both engines log)."""

    label: str
    text: str = ""
    detail: str = ""


def _read(response: httpx.Response, stream: bool, rid: str) -> SoakAnswer:
    """A finished response's answer."""
    if response.status_code != 200:
        return SoakAnswer(str(response.status_code), "", f"{rid}: status {response.status_code}")
    if not stream:
        data = response.json()
        choice = data["choices"][0]
        return SoakAnswer("200", str(choice.get("text") or (choice.get("message") or {}).get("content") or ""))
    text, done, error, events = "", False, "", 0
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            events += 1
            event = json.loads(line[6:])
            if "error" in event:
                error = json.dumps(event["error"])[:200]
                continue
            for choice in event.get("choices", []):
                text += str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    if done and not error:
        return SoakAnswer("200", text)
    return SoakAnswer("200 cut", text, f"{rid}: {events} events, " + (f"error {error}" if error else "no [DONE]"))


def _post(http: httpx.Client, url: str, path: str, payload: dict[str, Any]) -> SoakAnswer:
    """One request with its own x-request-id. An exception after the status line is a cut answer ("200 cut"), one
    before it "no answer"; either way the detail names the exception."""
    stream = bool(payload.get("stream"))
    rid = f"soak-{uuid.uuid4().hex[:16]}"
    status: int | None = None
    try:
        with http.stream(
            "POST", f"{url}{path}", json=payload, timeout=GUARD, headers={"x-request-id": rid}
        ) as response:
            status = response.status_code
            if not stream or response.status_code != 200:
                response.read()
            return _read(response, stream, rid)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        label = "no answer" if status is None else f"{status} cut"
        return SoakAnswer(label, "", f"{rid}: {type(exc).__name__}: {exc}"[:400])


def completion(http: httpx.Client, url: str, rng: random.Random, stream: bool) -> SoakAnswer:
    payload = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": rng.randint(8, 48), "stream": stream}
    return _post(http, url, "/v1/completions", payload)


def chat(http: httpx.Client, url: str, rng: random.Random, stream: bool) -> SoakAnswer:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": _prompt(rng)}]
    payload = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(8, 48), "stream": stream}
    return _post(http, url, "/v1/chat/completions", payload)


def session(http: httpx.Client, url: str, rng: random.Random) -> SoakAnswer:
    """Three turns; the label is the first turn's that was not 200 (else "200"). Short turns: the whole
    conversation stays within the bed's 2048-token context."""
    messages: list[dict[str, str]] = [{"role": "system", "content": rng.choice(SYSTEMS)}]
    for turn in range(3):
        messages.append({"role": "user", "content": _prompt(rng, 8, 24)})
        payload = {"model": MODEL, "messages": messages, "max_tokens": 24, "stream": turn % 2 == 1}
        answer = _post(http, url, "/v1/chat/completions", payload)
        if answer.label != "200":
            return replace(answer, detail=f"turn {turn + 1}: {answer.detail}")
        messages.append({"role": "assistant", "content": answer.text})
    return SoakAnswer("200")


def leaver(url: str, rng: random.Random, events: int = 3) -> SoakAnswer:
    """A stream read for `events` events, then the socket closed: "left" once it had its events."""
    raw = json.dumps({"model": MODEL, "prompt": _prompt(rng), "max_tokens": 64, "stream": True}).encode()
    parts = urlsplit(url)
    rid = f"soak-{uuid.uuid4().hex[:16]}"
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        f"x-request-id: {rid}\r\ncontent-length: {len(raw)}\r\n\r\n"
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
    except OSError as exc:
        return SoakAnswer("no answer", "", f"{rid}: {type(exc).__name__}: {exc}")
    if not seen.startswith(b"HTTP/1.1 200"):
        label = seen.split(b" ", 2)[1].decode(errors="replace") if seen.startswith(b"HTTP/") else "no answer"
        return SoakAnswer(label, "", f"{rid}: {seen[:200]!r}")
    if seen.count(b"data: ") >= events:
        return SoakAnswer("left")
    return SoakAnswer("200 cut", "", f"{rid}: the stream ended after {seen.count(b'data: ')} events")


BAD_BODIES: tuple[bytes, ...] = (
    b'{"model": "tiny", "prompt": "x", "max_tokens": -5}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 4',  # not JSON
    b'{"model": "tiny", "max_tokens": 4}',  # no prompt
    b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "n": 0}',
)


def bad(http: httpx.Client, url: str, rng: random.Random) -> SoakAnswer:
    body = rng.choice(BAD_BODIES)
    rid = f"soak-{uuid.uuid4().hex[:16]}"
    try:
        r = http.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json", "x-request-id": rid}
        )
    except httpx.HTTPError as exc:
        return SoakAnswer("no answer", "", f"{rid}: {type(exc).__name__}: {exc}")
    try:
        clear = isinstance(r.json().get("error"), dict)
    except ValueError:
        clear = False
    return SoakAnswer(f"{r.status_code}" + ("" if clear else " unclear"), "", f"{rid}: {body!r} -> {r.text[:200]}")


def expected(kind: str, label: str) -> bool:
    """Pure: the outcomes a kind may end with. Everything else is an unexpected outcome (the soak fails on it)."""
    if kind == "bad":
        return label.isdigit() and 400 <= int(label) < 500 and label != "429"
    if kind == "leaver":
        return label == "left"
    return label == "200"


def run_one(kind: str, url: str, rng: random.Random, since: float = 0.0) -> SoakOutcome:
    """One job of `kind`; `since`: the soak's start (monotonic), so an outcome says when it began."""
    t0 = time.monotonic()
    with httpx.Client(timeout=GUARD) as http:
        jobs: dict[str, Callable[[], SoakAnswer]] = {
            "completion-stream": lambda: completion(http, url, rng, True),
            "completion-json": lambda: completion(http, url, rng, False),
            "chat-stream": lambda: chat(http, url, rng, True),
            "chat-json": lambda: chat(http, url, rng, False),
            "session": lambda: session(http, url, rng),
            "leaver": lambda: leaver(url, rng),
            "bad": lambda: bad(http, url, rng),
        }
        answer = jobs[kind]()
    ok = expected(kind, answer.label)
    return SoakOutcome(kind, answer.label, ok, time.monotonic() - t0, t0 - since, "" if ok else answer.detail)


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

    def unexpected_details(self, most: int = 50) -> list[dict[str, Any]]:
        """The first `most` unexpected outcomes, each with when it began and why (for the report)."""
        with self.lock:
            bad = [o for o in self.outcomes if not o.expected][:most]
        return [asdict(o) for o in sorted(bad, key=lambda o: o.began_s)]


def _record(tally: Outcomes, kind: str, url: str, rng: random.Random, since: float) -> None:
    tally.add(run_one(kind, url, rng, since))


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
        t = since = time.monotonic()
        while t < until:
            time.sleep(max(0.0, t - time.monotonic()))
            job_rng = random.Random(rng.getrandbits(64))
            kind = rng.choices(kinds, weights)[0]
            pool.submit(_record, tally, kind, url, job_rng, since)
            arrivals += 1
            t += rng.expovariate(rate)
    return arrivals
