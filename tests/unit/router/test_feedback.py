"""router/feedback.py: what the decider is told, and a stream's close going forward to feedback and finish."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import httpx

from router.answer import StreamEnd
from router.decider import AnswerCheck, Decision, NoDecider, Outcome, Route, Turn
from router.domain import Endpoint, Mode, RequestInfo, WorkerView
from router.feedback import Feedback, StreamClose
from router.finish import Finisher
from router.legs.httpx import HttpxLegs
from router.metrics import Metrics
from router.timings import RequestRecord, TimingLog
from router.workers.pool import Pool

TURN = Turn(RequestInfo(Endpoint.COMPLETIONS, stream=True, prompt_tokens=3), {}, {}, Mode.PUSH)


class Told:
    name: ClassVar[str] = "told"
    wants_answer = True
    wants_token_ids = False
    wants_headers = False

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, decode: Sequence[WorkerView], prefill: Sequence[WorkerView], now: float) -> Decision:
        return Decision(Route.PUSH)

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None:
        self.outcomes.append(outcome)
        return None

    def forget(self, worker_id: str) -> None:
        return None


def feedback(decider: Told | NoDecider) -> Feedback:
    legs = HttpxLegs(httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))))
    return Feedback(decider, Pool([], Metrics()), legs, clock=lambda: 1.0)


def served() -> RequestRecord:
    return RequestRecord("r-1", "completions", "push", True, 0.0, prefill_worker="p0", decode_worker="d0")


def test_a_json_answer_is_parsed_for_the_decider() -> None:
    told = Told()
    answer = (
        b'{"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}}'
    )
    feedback(told).tell_json(TURN, Decision(Route.PUSH), served(), answer)
    (outcome,) = told.outcomes
    assert (outcome.ok, outcome.decode, outcome.prefill) == (True, "d0", "p0")
    assert (outcome.prompt_tokens, outcome.cached_tokens, outcome.answer) == (7, 4, "hi")


def test_a_stream_close_tells_the_decider_then_finishes_the_request() -> None:
    told, timings = Told(), TimingLog(10)
    rec = served()
    close = StreamClose(feedback(told), Finisher(Metrics(), timings, lambda: 2.0), TURN, Decision(Route.PUSH), rec)
    close(StreamEnd("ok", {"prompt_tokens": 5}, "text", None))
    assert [(o.ok, o.prompt_tokens, o.answer) for o in told.outcomes] == [(True, 5, "text")]
    assert (rec.outcome, rec.t_end) == ("ok", 2.0)


def test_no_decider_is_told_nothing_and_asks_for_nothing() -> None:
    none = feedback(NoDecider())
    none.tell(TURN, Decision(Route.PUSH), served(), ok=True)  # NoDecider.record is never reached: no parse
    assert not none.asks_ids_for_us({}) and none.collect(scrub=False) is None
