"""Where an answer another replica relayed sits in the engine's stored token ids (the estimate path's answer check,
router/deciders/session_affinity.py `_answer_from_events`): the answer's text as the chat request sends it back,
and its re-encoded ids aligned with the session's last stored blocks near the estimated start. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.kv_events.index import SessionTail

MIN_AGREED = 2  # an answer is placed in the engine's stored ids where this many of its tokens agree (else a first
# token that also ends the prompt could place it early)


def assistant_text(body: Mapping[str, Any], index: int) -> str | None:
    """The text of the chat request's `index`-th message when it is the assistant's (a relayed answer)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 <= index < len(messages):
        return None
    message = messages[index]
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return None
    content = message.get("content")
    return content if isinstance(content, str) and content else None


def align(tail: SessionTail, answer: Sequence[int], guess: int, slack: int) -> tuple[int, int]:
    """(start, agreed): the chain position within `slack` of `guess` from which the tail's token ids agree with
    `answer` the longest (ties: the nearest to `guess`), and for how many tokens; (guess, 0) when nowhere do
    `MIN_AGREED` agree (the answer's first token re-tokenized otherwise, or no stored block reaches it)."""
    ids = tail.tokens
    if not answer:
        return guess, 0
    low, high = max(0, guess - slack - tail.start), min(len(ids), guess + slack - tail.start + 1)
    starts, at = [], low
    while at < high:  # the places the answer's first id is stored (C's search, not a Python loop per position)
        try:
            at = ids.index(answer[0], at, high)
        except ValueError:
            break
        starts.append(at)
        at += 1
    best, agreed = guess, 0
    for offset in sorted(starts, key=lambda o: abs(o + tail.start - guess)):
        n, limit = 1, min(len(answer), len(ids) - offset)
        while n < limit and ids[offset + n] == answer[n]:
            n += 1
        if n > agreed:
            best, agreed = tail.start + offset, n
            if n == len(answer):
                break
    return (best, agreed) if agreed >= min(MIN_AGREED, len(answer)) else (guess, 0)
