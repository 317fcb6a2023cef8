"""What the fault matrix's clients do: well-behaved requests (outcome recorded) and misbehaving ones (raw
sockets that leave early, upload partly, or read slowly)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

GUARD = 200.0  # hang guard of one client request: longer than every default leg deadline the rows may hit


@dataclass
class Result:
    """One client request's outcome, as the client saw it."""

    status: int | None  # None: no answer (connection failed or cut before a status)
    complete: bool  # a stream read to [DONE] or a JSON answer with choices
    error: str | None  # the OpenAI error's type (a JSON error answer or an in-band error event)
    t_end: float  # monotonic time of the outcome

    @property
    def label(self) -> str:
        if self.status is None:
            return "no answer"
        if self.status == 200 and not self.complete:
            return "200 cut" + (f" ({self.error})" if self.error else "")
        return str(self.status)

    @property
    def acceptable(self) -> bool:
        """Served, or refused/failed with a clear OpenAI-style error (a stream cut with an error event counts)."""
        if self.status == 200:
            return self.complete or self.error is not None
        return self.status in (429, 502, 503, 504) and self.error is not None


def body(max_tokens: int = 16, stream: bool = True, words: int = 40) -> dict[str, Any]:
    prompt = f"# {uuid.uuid4().hex}\n" + " ".join(f"def f{i}(x): return x * {i}" for i in range(words))
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def request(url: str, payload: dict[str, Any], timeout: float = GUARD) -> Result:
    """One request; a stream is read to its end. Never raises for a network failure: that is an outcome (no answer
    before a status; after one, a cut answer with what had come: `200 cut` for a stream cut without an error)."""
    status: int | None = None
    content = b""
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream("POST", f"{url}/v1/completions", json=payload) as response,
        ):
            status = response.status_code
            for piece in response.iter_bytes():
                content += piece
    except httpx.HTTPError:
        if status is None:
            return Result(None, False, None, time.monotonic())
        judged = _judge(status, content, bool(payload.get("stream")))
        return Result(judged.status, False, judged.error, judged.t_end)
    return _judge(status, content, bool(payload.get("stream")))


def _judge(status: int, content: bytes, stream: bool) -> Result:
    now = time.monotonic()
    if status != 200:
        try:
            error = json.loads(content)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            error = None
        return Result(status, False, error, now)
    if not stream:
        try:
            return Result(200, bool(json.loads(content).get("choices")), None, now)
        except ValueError:
            return Result(200, False, None, now)
    error = None
    for line in content.decode(errors="replace").splitlines():
        if line.startswith("data: {") and '"error"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                error = json.loads(line[6:])["error"]["type"]
    return Result(200, b"data: [DONE]" in content and error is None, error, now)


def summary(results: list[Result]) -> str:
    counts = Counter(r.label for r in results)
    return ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(GUARD)
    sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
    return sock


def _head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def leave_before_first_byte(url: str, payload: dict[str, Any]) -> float:
    """Sends a whole request and hangs up at once; returns the time it hung up."""
    raw = json.dumps(payload).encode()
    sock = _connect(url)
    sock.sendall(_head(len(raw)) + raw)
    sock.close()
    return time.monotonic()


def leave_mid_stream(url: str, payload: dict[str, Any], events: int = 3) -> float:
    """Reads `events` stream events, then hangs up; returns the time it hung up."""
    raw = json.dumps(payload).encode()
    sock = _connect(url)
    try:
        sock.sendall(_head(len(raw)) + raw)
        seen = b""
        while seen.count(b"data: ") < events:
            chunk = sock.recv(4096)
            if not chunk:
                break
            seen += chunk
    finally:
        sock.close()
    return time.monotonic()


def leave_mid_upload(url: str, declared: int = 2**20, sent: int = 10 * 2**10) -> float:
    """Declares a body of `declared` bytes, sends `sent` of them, hangs up; returns the time it hung up."""
    sock = _connect(url)
    try:
        sock.sendall(_head(declared) + b'{"model": "tiny", "prompt": "' + b"x" * sent)
        time.sleep(0.2)
    finally:
        sock.close()
    return time.monotonic()


def slow_reader(url: str, payload: dict[str, Any], piece: int = 512, pause: float = 0.2) -> Result:
    """Reads the stream `piece` bytes at a time with a small receive buffer; the outcome once it ends."""
    raw = json.dumps(payload).encode()
    sock = _connect(url, rcvbuf=4096)
    content = b""
    try:
        sock.sendall(_head(len(raw)) + raw)
        while True:
            chunk = sock.recv(piece)
            if not chunk:
                break
            content += chunk
            if b"0\r\n\r\n" in content[-16:] or b"data: [DONE]" in content:
                break
            time.sleep(pause)
    except OSError:
        pass
    finally:
        sock.close()
    if not content:
        return Result(None, False, None, time.monotonic())
    status = int(content.split(b" ", 2)[1])
    return _judge(status, content.partition(b"\r\n\r\n")[2], True)
