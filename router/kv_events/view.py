"""What the deciders read: per worker, the longest prefix of a prompt its engine holds, and whether to trust it.

`KvEventView` is read-only over the index the subscriber fills. A decider asks `held_prefixes(token_ids, workers)`
(the prompt's chain keys are computed once, lazily, for all workers) and `caught_up(worker)`: every DP rank of the
worker is in sync and its history complete, so the view alone may decide. Otherwise (events off for that worker,
a replay running, or a hole since the engine's cache was last cleared) the view is a subset of the truth: the
decider keeps its request-learned estimate as the fallback (e.g. the larger of the two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.kv_events.index import HeldPrefix, KvIndex, PromptKeys, SessionTail
from router.kv_events.stream import StreamStatus


@dataclass(frozen=True)
class KvEventReport:
    """For /metrics: the subscriber's flat counters (`KvEventSubscriber.counters`) and, per worker followed,
    (caught up, blocks held)."""

    counters: Mapping[str, int]
    workers: Mapping[str, tuple[bool, int]]


class KvEventView:
    def __init__(self, index: KvIndex, status: Callable[[str], list[StreamStatus]]) -> None:
        self._index = index
        self._status = status

    def held_prefix(self, worker: str, token_ids: Sequence[int] | PromptKeys) -> HeldPrefix:
        return self._index.longest_held_prefix(worker, token_ids)

    def held_prefixes(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, HeldPrefix]:
        prompt = PromptKeys(token_ids)
        return {worker: self._index.longest_held_prefix(worker, prompt) for worker in workers}

    def session_holders(self, session_id: str) -> dict[str, int]:
        """Per worker, how many blocks the session's requests stored (vLLM's `session_id`, sent by the router as
        `X-Session-ID` or the body's `session_id`) that its engine still holds; no tokenizer needed."""
        return self._index.session_holders(session_id)

    def session_tokens(self, session_id: str) -> dict[str, int]:
        """Per worker, the tokens of the session's chain held there (router/kv_events/index.py: the end of the
        session's tip, which counts the blocks another session stored first, e.g. a shared system prompt): what a
        next turn of the session finds cached there, at most."""
        return self._index.session_tokens(session_id)

    def session_tail(self, worker: str, session_id: str) -> SessionTail | None:
        """The token ids of the session's blocks `worker` stored last and still holds, with their place in the
        chain: what a decider checks an answer it never relayed against (its generated ids)."""
        return self._index.session_tail(worker, session_id)

    def subscribed(self, worker: str) -> bool:
        return bool(self._status(worker))

    def caught_up(self, worker: str) -> bool:
        streams = self._status(worker)
        return bool(streams) and all(stream.caught_up for stream in streams)

    def status(self, worker: str) -> list[StreamStatus]:
        return self._status(worker)
