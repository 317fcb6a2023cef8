"""Prompts of an exact token length, each with a unique prefix, for a word-count or a server tokenizer."""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

WORDS = 10_000  # synthetic vocabulary: the words "0" .. "9999"
FIT_TRIES = 8


class Tokenizer(Protocol):
    """How a server counts tokens; `encode` includes the special tokens the server adds (e.g. BOS)."""

    async def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    async def decode(self, ids: Sequence[int]) -> str: ...


def word_ids(text: str) -> list[int]:
    """The synthetic tokenizer: one token per whitespace-separated word; numbers map to themselves + 1."""
    return [int(w) + 1 if w.isdigit() and int(w) < WORDS else 0 for w in text.split()]


def word_text(ids: Sequence[int]) -> str:
    return " ".join(str(i - 1) if i > 0 else "x" for i in ids)


class WordTokenizer:
    """Count-based synthetic tokenizer (the engine simulator counts tokens the same way); no specials."""

    async def encode(self, text: str, *, special: bool = True) -> list[int]:
        return word_ids(text)

    async def decode(self, ids: Sequence[int]) -> str:
        return word_text(ids)


class HttpTokenizer:
    """A vLLM server's own tokenizer through its POST /tokenize and /detokenize endpoints."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, timeout_s: float = 30.0):
        self._client = client
        self._base = base_url.rstrip("/")
        self._model = model
        self._timeout = timeout_s

    async def encode(self, text: str, *, special: bool = True) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": special}
        resp = await self._client.post(f"{self._base}/tokenize", json=body, timeout=self._timeout)
        resp.raise_for_status()
        return [int(t) for t in resp.json()["tokens"]]

    async def decode(self, ids: Sequence[int]) -> str:
        body = {"model": self._model, "tokens": list(ids)}
        resp = await self._client.post(f"{self._base}/detokenize", json=body, timeout=self._timeout)
        resp.raise_for_status()
        return str(resp.json()["prompt"])


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as the tokenizer counts it, specials included


def unique_prefix(salt: int, index: int, rng: random.Random) -> str:
    """A few number-words no other prompt of any run starts with (salt per run, index per request)."""
    return f"{salt % WORDS} {index % WORDS} {index // WORDS % WORDS} {rng.randrange(WORDS)}"


def filler(rng: random.Random, words: int) -> str:
    return " ".join(str(rng.randrange(WORDS)) for _ in range(words))


async def build_prompt(tok: Tokenizer, n_tokens: int, salt: int, index: int, rng: random.Random) -> Prompt:
    """A prompt the tokenizer counts as exactly `n_tokens` (closest reachable if a retokenization drifts)."""
    if n_tokens < 1:
        raise ValueError("n_tokens must be >= 1")
    specials = len(await tok.encode("", special=True))
    body_len = max(n_tokens - specials, 1)
    draft = unique_prefix(salt, index, rng) + " " + filler(rng, body_len + 8)
    pool = await tok.encode(draft, special=False)
    best: Prompt | None = None
    cut = min(body_len, len(pool))
    for _ in range(FIT_TRIES):
        text = await tok.decode(pool[:cut])
        count = len(await tok.encode(text, special=True))
        if best is None or abs(count - n_tokens) < abs(best.tokens - n_tokens):
            best = Prompt(text, count)
        if count == n_tokens:
            break
        cut += 1 if count < n_tokens else -1
        if cut < 1 or cut > len(pool):
            break
    assert best is not None
    return best
