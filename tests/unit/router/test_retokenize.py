"""Answer checks: one /tokenize per check, settled with the matched tokens; bounded, deadlined, cancelled on close."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from router.decider import AnswerCheck
from router.legs.httpx import HttpxLegs
from router.retokenize import Retokenizer


def legs(handler: Any) -> HttpxLegs:
    return HttpxLegs(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def check_into(settled: list[tuple[int, int]], generated: tuple[int, ...] = (1, 2, 3, 4)) -> AnswerCheck:
    return AnswerCheck("http://d1:8200", "some text", generated, lambda n, m, _: settled.append((n, m)))


async def never_answers(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def drain(checks: Retokenizer) -> None:
    for _ in range(5000):  # each check is a task of its own: let them run (a deadline needs the clock to move)
        if not len(checks):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the checks did not end")


async def test_a_check_posts_the_text_to_the_worker_and_settles_with_the_common_run() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={"count": 4, "tokens": [1, 2, 9, 4], "max_model_len": 64})

    settled: list[tuple[int, int]] = []
    checks = Retokenizer(legs(handler), lambda: 7.0)
    assert checks.submit("http://d1:8200", check_into(settled))
    await drain(checks)
    assert seen == [("http://d1:8200/tokenize", {"prompt": "some text", "add_special_tokens": False})]
    assert settled == [(2, 4)] and checks.settled == 1


@pytest.mark.parametrize(
    "answer",
    [httpx.Response(500, text="boom"), httpx.Response(200, json={"tokens": "nope"}), httpx.Response(200, text="[")],
)
async def test_a_failed_check_leaves_the_estimate(answer: httpx.Response) -> None:
    settled: list[tuple[int, int]] = []
    checks = Retokenizer(legs(lambda _: answer), lambda: 0.0)
    checks.submit("http://d1:8200", check_into(settled))
    await drain(checks)
    assert settled == [] and checks.failed == 1


async def test_a_check_that_gets_no_answer_ends_at_its_deadline() -> None:
    settled: list[tuple[int, int]] = []
    checks = Retokenizer(legs(never_answers), lambda: 0.0, deadline=0.01)
    checks.submit("http://d1:8200", check_into(settled))
    await drain(checks)
    assert settled == [] and checks.failed == 1


async def test_checks_beyond_the_bound_are_dropped_and_close_cancels_the_rest() -> None:
    settled: list[tuple[int, int]] = []
    checks = Retokenizer(legs(never_answers), lambda: 0.0, max_pending=2)
    assert [checks.submit("http://d1:8200", check_into(settled)) for _ in range(3)] == [True, True, False]
    assert checks.dropped == 1
    await asyncio.sleep(0)
    await checks.aclose()
    assert len(checks) == 0 and settled == []


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive deadline"):
        Retokenizer(legs(lambda _: httpx.Response(200)), lambda: 0.0, deadline=0)
