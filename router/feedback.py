"""The decider's side of every request: what it is told of each attempt, and the answer checks it asks for.

The dispatcher asks the decider once per attempt (router/dispatch.py); everything after that is here:
- `tell` builds the attempt's `Outcome` (from a JSON answer, or from what a stream's relay collected) and hands
  it to the decider's `record` (skipped for NoDecider, which learns nothing);
- an `AnswerCheck` the decider hands back goes to a worker that tokenizes the same (`_submit_check`, run off the
  request's path by router/retokenize.py);
- whether decode is asked for the answer's token ids the client did not ask for (`asks_ids_for_us`), and what
  a stream's relay collects for the decider (`collect`).
A stream's end reaches this module forward, through the `StreamClose` its answer owns: no call goes back into
the dispatcher.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router import protocol
from router.answer import Collect, StreamEnd
from router.decider import AnswerCheck, Decider, Decision, NoDecider, Outcome, Turn
from router.domain import RequestInfo, Role
from router.finish import Finisher
from router.legs.base import LegTransport
from router.policy import LeastInFlight
from router.retokenize import Retokenizer
from router.timings import RequestRecord
from router.tracing.trace import LegSpan, RequestTrace
from router.workers.pool import Pool

logger = logging.getLogger("kvpush.dispatch")  # the dispatcher's logger: the log lines are API


class Feedback:
    """Owns the decider, the `Retokenizer` and where its checks go."""

    def __init__(self, decider: Decider, pool: Pool, legs: LegTransport, clock: Callable[[], float]) -> None:
        self.decider = decider
        self._pool = pool
        self._clock = clock
        self._learns = not isinstance(decider, NoDecider)  # NoDecider.record does nothing: skip the parse
        self._wants_ids = decider.wants_answer and decider.wants_token_ids
        self._checks = Retokenizer(legs, clock)  # the decider's answer checks (router/retokenize.py)
        self._tokenizers = LeastInFlight()  # where a check goes when no prefill served its request

    def asks_ids_for_us(self, client_body: Mapping[str, Any]) -> bool:
        """The decider wants the answer's token ids and the client did not ask for them: decode is asked, and
        what the client gets is scrubbed of them."""
        return self._wants_ids and not protocol.asks_token_ids(client_body)

    def collect(self, scrub: bool) -> Collect | None:
        if not self.decider.wants_answer:
            return None
        ids_of = protocol.token_ids_of if self._wants_ids else None
        return Collect(protocol.text_of, ids_of, protocol.scrub_token_ids if scrub else None)

    def tell_json(self, turn: Turn, decision: Decision, rec: RequestRecord, answer: bytes) -> None:
        """A whole JSON answer: its usage, text and token ids, parsed again for the decider."""
        if not self._learns or rec.decode_worker is None:
            return
        parsed = _json_or_none(answer)
        text = protocol.text_of(parsed) if self.decider.wants_answer else None
        found = protocol.token_ids_of(parsed) if self._wants_ids else None
        ids = None if found is None else tuple(found)
        self.tell(turn, decision, rec, ok=True, usage=protocol.usage_of(parsed), text=text, ids=ids)

    def tell(
        self,
        turn: Turn,
        decision: Decision,
        rec: RequestRecord,
        *,
        ok: bool,
        usage: dict[str, Any] | None = None,
        text: str | None = None,
        ids: tuple[int, ...] | None = None,
    ) -> None:
        """The attempt's Outcome for the decider (skipped for NoDecider, which learns nothing)."""
        if not self._learns or rec.decode_worker is None:
            return
        details = usage.get("prompt_tokens_details") if usage else None
        outcome = Outcome(
            ok=ok,
            decode=rec.decode_worker,
            prefill=rec.prefill_worker,
            prompt_tokens=_int_or_none(usage, "prompt_tokens"),
            cached_tokens=_int_or_none(details if isinstance(details, dict) else None, "cached_tokens"),
            completion_tokens=_int_or_none(usage, "completion_tokens"),
            answer=text,
            answer_token_ids=ids,
        )
        try:
            check = self.decider.record(turn, decision, outcome, self._clock())
        except Exception:  # a decider's bug must not fail a request that is already answered
            logger.exception("decider %s failed to record an outcome", self.decider.name)
            return
        if check is not None:
            self._submit_check(check, rec.prefill_worker, turn.info)

    def _submit_check(self, check: AnswerCheck, prefill: str | None, info: RequestInfo) -> None:
        """To the prefill worker that served the request while it is healthy (the prefill policy chose it), else
        to the healthy prefill worker with the fewest requests in flight, in turn on ties (a turn decode served
        alone), else to the decode worker itself. A prefill worker serves the same model, so it tokenizes the
        same, and the /tokenize call stays off the decode worker streaming others' tokens."""
        healthy = self._pool.candidates(Role.PREFILL)
        served = [w for w in healthy if w.id == prefill]
        target = (served[0] if served else self._tokenizers.select(healthy, info)).id if healthy else check.worker
        if target in self._pool:
            self._checks.submit(self._pool.get(target).spec.url, check)

    def forget(self, worker_id: str) -> None:
        """A worker went down or left the pool: the decider drops what it knew of it."""
        self.decider.forget(worker_id)

    async def aclose(self) -> None:
        await self._checks.aclose()


@dataclass(frozen=True)
class StreamClose:
    """A relayed stream's end, owned by its StreamAnswer: the decider is told, then the record is finished."""

    feedback: Feedback
    finisher: Finisher
    turn: Turn
    decision: Decision
    rec: RequestRecord
    trace: RequestTrace | None = None  # the request's trace, ended here with the stream's outcome
    decode_leg: LegSpan | None = None  # the decode leg's span (set by the dispatcher once the stream opened)

    def __call__(self, end: StreamEnd) -> None:
        ok = end.outcome == "ok"
        self.feedback.tell(self.turn, self.decision, self.rec, ok=ok, usage=end.usage, text=end.text, ids=end.token_ids)
        if self.decode_leg is not None:
            self.decode_leg.end(end.outcome)
        self.finisher.finish(self.rec, end.outcome, self.trace, status=200, usage=end.usage)


def _json_or_none(raw: bytes) -> Any:
    try:
        return protocol.decode_json(raw)
    except ValueError:
        return None


def _int_or_none(mapping: dict[str, Any] | None, key: str) -> int | None:
    value = mapping.get(key) if mapping else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
