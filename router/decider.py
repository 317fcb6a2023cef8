"""The P/D decider: for each request, whether to push, pull or bypass prefill, and which workers it prefers. Pure.

The dispatcher asks the configured decider once per attempt (`decide`), executes the `Decision`, and tells the
decider how the attempt ended (`record`), so a decider that keeps an index (what each worker's prefix cache holds)
learns from every answer. `record` may hand back an `AnswerCheck`: the dispatcher then asks the decode worker to
tokenize the answer's text (off the request's path: router/retokenize.py) and settles the check with how many
generated tokens the text re-tokenizes to, which is how far the next turn can match decode's prefix cache.
Deciders are small registered classes chosen by the `decider` setting, like the selection policies; "none" is
the behaviour without a decider: the configured mode, workers chosen by the policies. This module is the seam
only: the registry and the implementations live in router/deciders/ (registry.py imports every decider; the seam
imports none).

Routes:
- PUSH / PULL: both legs, as the router's mode says (a decider never changes the mode; it may only bypass).
- BYPASS: no prefill leg; decode computes the (short) uncached suffix from its own prefix cache.
- FALLBACK: no prefill leg because no prefill worker is usable (the decode-only fallback); set by the dispatcher.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from router.domain import Fallback, Mode, RequestInfo, WorkerView


class Route(enum.StrEnum):
    """How one attempt is served. The value is the decisions metric's label; `label` is the request's mode."""

    PUSH = "push"
    PULL = "pull"
    BYPASS = "bypass"
    FALLBACK = "fallback"

    @classmethod
    def of(cls, mode: Mode) -> Route:
        """The route of the router's mode (both legs)."""
        return cls.PUSH if mode is Mode.PUSH else cls.PULL

    @property
    def label(self) -> str:
        """The request's mode in its log line, its record and the metrics' `mode` label (API: unchanged)."""
        return str(Fallback.DECODE_ONLY) if self is Route.FALLBACK else self.value


@dataclass(frozen=True)
class Turn:
    """What a decider sees of one client request. Built by the dispatcher from the validated request."""

    info: RequestInfo
    body: Mapping[str, Any]  # the client's JSON body, read-only
    headers: Mapping[str, str]  # the client's headers, lower-case names
    mode: Mode  # the router's configured mode


@dataclass(frozen=True)
class Decision:
    """What to do with one attempt. `decode`/`prefill` are preferred worker ids; None lets the policy pick."""

    route: Route
    decode: str | None = None
    prefill: str | None = None
    predicted_cached_tokens: int = 0  # prompt tokens the decider expects the serving worker(s) to hold already
    reason: str = ""  # one short phrase for the request log
    state: Any = field(default=None, compare=False, repr=False)  # the decider's own, handed back in `record`


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the dispatcher saw it."""

    ok: bool  # the client got a whole answer
    decode: str  # decode worker id that served it
    prefill: str | None  # prefill worker id, None for BYPASS/FALLBACK
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the engine reported it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    completion_tokens: int | None = None
    answer: str | None = None  # the generated text, only when the decider's `wants_answer` is True
    answer_token_ids: tuple[int, ...] | None = None  # its token ids, when `wants_token_ids` and decode sent them


@dataclass(frozen=True)
class AnswerCheck:
    """A question for the decode worker that generated `generated`: how many of those tokens does `text`
    re-tokenize to, in order? `settle(matched, count, now)` hands the answer back to the decider: the generated
    tokens matched (`matched_tokens`) and how many tokens the text re-tokenizes to in all."""

    worker: str
    text: str
    generated: tuple[int, ...]
    settle: Callable[[int, int, float], None] = field(compare=False, repr=False)


def matched_tokens(generated: Sequence[int], retokenized: Sequence[int]) -> int:
    """How many generated tokens a next turn finds in decode's prefix cache when it sends their text back: the
    common leading run of the generated and the re-tokenized ids, less the last generated token (it was sampled,
    never fed back, so it has no KV)."""
    limit = min(len(generated) - 1, len(retokenized))
    n = 0
    while n < limit and generated[n] == retokenized[n]:
        n += 1
    return n


class Decider(Protocol):
    """Decides per attempt; learns from outcomes; forgets a worker that was ejected, removed or restarted."""

    name: ClassVar[str]
    wants_answer: bool  # the dispatcher collects the generated text for `record` only when True
    wants_token_ids: bool  # ... and asks decode for its token ids (scrubbed from what the client gets)
    wants_headers: bool  # the HTTP layer copies the client's headers into the `Turn` only when True

    def decide(
        self, turn: Turn, decode: Sequence[WorkerView], prefill: Sequence[WorkerView], now: float
    ) -> Decision: ...

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None: ...

    def forget(self, worker_id: str) -> None: ...


@dataclass(frozen=True)
class DeciderStats:
    """A decider's counters for the metrics module (deciders that keep an index expose `stats()`)."""

    decisions: Mapping[str, int]  # by route (as the decider decided; the dispatcher counts FALLBACK itself)
    index_links: Mapping[str, int]  # by role: links of the prefix index (one per message / prompt chunk)
    sessions: int  # entries of the session -> decode worker table
    evictions: Mapping[str, int]  # "<decode|prefill|sessions>/<capacity|expired|forgotten>" -> count
    predicted_cached_tokens: int  # summed over bypass decisions whose usage reported cached tokens
    actual_cached_tokens: int  # the same decisions' usage.prompt_tokens_details.cached_tokens
    checked_bypasses: int  # bypass decisions with usage to check the prediction against
    accurate_bypasses: int  # ... whose predicted uncached tokens were within 20 % of the actual
    tokens_per_char: float  # the learned ratio
    answers_trusted: bool = True  # False once bypasses showed relayed answers are not what decode caches
    answers_checked: int = 0  # answers whose re-tokenization decode reported (`AnswerCheck`)
    answers_short: int = 0  # ... that matched fewer generated tokens than the first estimate credited
    event_decisions: int = 0  # decisions whose decode pick a caught-up KV-event view judged
    event_corrections: int = 0  # learned matches the KV events cut down (evicted, restarted, elsewhere)
    event_matches: int = 0  # matches only the KV events knew of (another replica routed the session)
    event_answer_checks: int = 0  # answers another replica relayed, checked against the engine's stored ids


class ReportsStats(Protocol):
    def stats(self) -> DeciderStats: ...


def stats_of(decider: Decider) -> DeciderStats | None:
    """The decider's counters, None for one that keeps none ("none")."""
    report = getattr(decider, "stats", None)
    return report() if callable(report) else None


class NoDecider:
    """Today's behaviour exactly: the configured mode, both legs, workers picked by the selection policies."""

    name: ClassVar[str] = "none"
    wants_answer = False
    wants_token_ids = False
    wants_headers = False

    def decide(self, turn: Turn, decode: Sequence[WorkerView], prefill: Sequence[WorkerView], now: float) -> Decision:
        return Decision(Route.of(turn.mode))

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None:
        return None

    def forget(self, worker_id: str) -> None:
        return None
