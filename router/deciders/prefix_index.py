"""What the router believes each worker's prefix cache holds, learned from what it sent and relayed. Pure.

A `PrefixIndex` maps, per worker, chain links (router/deciders/conversation.py) to the tokens held up to that
link. It is an estimate of the engine's own LRU prefix cache: bounded per worker (least recently used links go
first) and aged out after `ttl_s`, which should stay below the horizon at which the engines evict an idle prefix.
A worker that is ejected, removed or restarted is forgotten whole (its cache is gone or unknown).

`SessionTable` remembers the decode worker that served a client's session last (bounded, aged the same way).
`TokenRatio` learns tokens per character from the prompt sizes the engines report, for the parts of a prompt the
index has no exact count for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.deciders.conversation import Chain, ChainLink


@dataclass(frozen=True)
class Held:
    tokens: int  # prompt tokens up to this link (its position in the prompt)
    at: float  # when it was last sent there (the engine's LRU clock, roughly)
    reusable: int  # of those, the tokens the engine's prefix cache can match (less after an answer that does not
    # re-tokenize as it was generated: see `reusable_answer_tokens`)


@dataclass(frozen=True)
class Match:
    """The longest prefix of a chain one worker holds."""

    worker: str
    links: int  # how many leading links of the chain it holds (0: nothing)
    chars: int
    tokens: int
    reusable: int  # <= tokens: what a request extending the chain would find cached


@dataclass
class Evictions:
    capacity: int = 0  # pushed out by the per-worker bound
    expired: int = 0  # older than the TTL
    forgotten: int = 0  # dropped with a forgotten worker


class PrefixIndex:
    def __init__(self, max_links_per_worker: int, ttl_s: float) -> None:
        if max_links_per_worker < 1 or ttl_s <= 0:
            raise ValueError("the index needs a positive bound and a positive TTL")
        self._max = max_links_per_worker
        self._ttl = ttl_s
        self._held: dict[str, OrderedDict[bytes, Held]] = {}
        self.evictions = Evictions()

    def __len__(self) -> int:
        return sum(len(links) for links in self._held.values())

    def workers(self) -> list[str]:
        return sorted(self._held)

    def size(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def record(
        self, worker: str, links: Sequence[ChainLink], tokens: Sequence[int], now: float, reusable: int | None = None
    ) -> None:
        """`worker` now holds every link of `links` (a chain's leading links), `tokens[i]` tokens up to link i, of
        which its cache can match at most `reusable` (None: all of them)."""
        if len(links) != len(tokens):
            raise ValueError("one token count per link")
        held = self._held.setdefault(worker, OrderedDict())
        for link, count in zip(links, tokens, strict=True):
            held[link.digest] = Held(count, now, count if reusable is None else min(count, reusable))
            held.move_to_end(link.digest)
        while len(held) > self._max:
            held.popitem(last=False)
            self.evictions.capacity += 1

    def refine(
        self, worker: str, links: Sequence[ChainLink], recorded_at: float, reusable: int, tokens: Sequence[int]
    ) -> None:
        """What `worker` holds through `links`, as recorded at `recorded_at`, is now known: `tokens[i]` tokens up
        to link i in a prompt that sends them back, of which its cache can match `reusable` (an answer checked
        after it was recorded). A link recorded again since (a later turn sent it as prompt: computed, so cached
        whole), evicted or aged out is left as it is."""
        held = self._held.get(worker)
        if held is None:
            return
        for link, count in zip(links, tokens, strict=True):
            found = held.get(link.digest)
            if found is not None and found.at == recorded_at:
                held[link.digest] = Held(count, found.at, min(count, reusable))

    def longest(self, worker: str, chain: Chain, now: float) -> Match:
        """The longest leading run of `chain`'s links the worker holds (a link held without its predecessors
        cannot be: links are recorded whole-prefix, and a chain digest covers everything before it)."""
        held = self._held.get(worker)
        if held is not None:
            self._expire(held, now)
            for i in range(len(chain.links) - 1, -1, -1):
                found = held.get(chain.links[i].digest)
                if found is not None:
                    return Match(worker, i + 1, chain.links[i].chars, found.tokens, found.reusable)
        return Match(worker, 0, 0, 0, 0)

    def forget(self, worker: str) -> None:
        dropped = self._held.pop(worker, None)
        if dropped:
            self.evictions.forgotten += len(dropped)

    def expire(self, now: float) -> None:
        for held in self._held.values():
            self._expire(held, now)

    def _expire(self, held: OrderedDict[bytes, Held], now: float) -> None:
        while held:
            digest, first = next(iter(held.items()))
            if now - first.at < self._ttl:
                return
            del held[digest]
            self.evictions.expired += 1


class SessionTable:
    """Session id -> the decode worker that served it last; LRU-bounded and aged out after `ttl_s`."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError("the session table needs a positive bound and a positive TTL")
        self._max = max_sessions
        self._ttl = ttl_s
        self._last: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.evictions = Evictions()

    def __len__(self) -> int:
        return len(self._last)

    def get(self, session: str, now: float) -> str | None:
        entry = self._last.get(session)
        if entry is None:
            return None
        if now - entry[1] >= self._ttl:
            del self._last[session]
            self.evictions.expired += 1
            return None
        return entry[0]

    def set(self, session: str, worker: str, now: float) -> None:
        self._last[session] = (worker, now)
        self._last.move_to_end(session)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
            self.evictions.capacity += 1
        while self._last:  # the oldest first: stop at the first fresh one
            oldest, (_, at) = next(iter(self._last.items()))
            if now - at < self._ttl:
                break
            del self._last[oldest]
            self.evictions.expired += 1

    def forget(self, worker: str) -> None:
        stale = [s for s, (w, _) in self._last.items() if w == worker]
        for session in stale:
            del self._last[session]
        self.evictions.forgotten += len(stale)


class TokenRatio:
    """Tokens per character, learned as a moving average of what the engines report (usage.prompt_tokens)."""

    def __init__(self, initial: float = 0.25, weight: float = 0.1) -> None:
        if initial <= 0 or not 0 < weight <= 1:
            raise ValueError("the ratio and its weight must be positive (weight at most 1)")
        self.value = initial
        self._weight = weight
        self.samples = 0

    def learn(self, tokens: int, chars: int) -> None:
        if tokens <= 0 or chars <= 0:
            return
        sample = tokens / chars
        weight = 1.0 if self.samples == 0 else self._weight  # the first report replaces the guess
        self.value += weight * (sample - self.value)
        self.samples += 1

    def tokens(self, chars: int) -> int:
        return max(0, round(chars * self.value))


def reusable_answer_tokens(answer: str, completion_tokens: int) -> int:
    """How many of an answer's generated tokens a next turn that sends its text back can find in the prefix cache.

    The engine re-tokenizes the text, and its cache matches only as far as that yields the tokens it generated.
    Without a tokenizer two cases are certain: text holding U+FFFD (a token sequence that was not valid UTF-8, so
    the text cannot encode back to the same bytes) matches at most up to that character; and an answer with more
    tokens than bytes (beyond the final one) carries tokens its text does not show (special tokens, stripped
    output) and is taken to match nothing. The last generated token is never fed back, so its KV does not exist."""
    if completion_tokens <= 0:
        return 0
    if completion_tokens - 1 > len(answer.encode("utf-8", "surrogatepass")):
        return 0
    stop = answer.find("\ufffd")
    if stop < 0:
        return completion_tokens - 1
    return min(completion_tokens - 1, completion_tokens * stop // len(answer))


def prorated(links: Iterable[ChainLink], total_chars: int, total_tokens: int) -> list[int]:
    """Token counts up to each link, the request's own tokens spread over its characters (the last link of a
    whole prompt gets exactly `total_tokens` when its chars are the total)."""
    if total_chars <= 0:
        return [0 for _ in links]
    return [round(total_tokens * link.chars / total_chars) for link in links]
