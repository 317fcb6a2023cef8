"""The multi-turn session plan, one streamed turn's bookkeeping, and the per-turn figures (no sockets)."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import httpx
import pytest

from loadtest import multiturn
from loadtest.records import ClientRecord

SHAPE = multiturn.SessionShape(sessions=20, session_rate=0.5, seed=4)


def test_the_plan_is_determined_by_its_shape() -> None:
    assert multiturn.plan_sessions(SHAPE) == multiturn.plan_sessions(SHAPE)
    assert multiturn.plan_sessions(SHAPE) != multiturn.plan_sessions(multiturn.SessionShape(20, 0.5, seed=5))


def test_sessions_respect_every_range_and_start_in_order() -> None:
    sessions = multiturn.plan_sessions(SHAPE)
    assert len(sessions) == 20 and len({s.id for s in sessions}) == 20
    starts = [s.start_s for s in sessions]
    assert starts[0] == 0.0 and starts == sorted(starts)
    for s in sessions:
        assert 6 <= len(s.turns) <= 10
        assert [t.kind for t in s.turns[:2]] == ["user", "tool"]
        for t in s.turns:
            assert 50 <= t.message_tokens <= 500 and 32 <= t.answer_tokens <= 128 and t.think_s >= 0


def test_message_text_has_the_asked_number_of_words_and_a_unique_head() -> None:
    text = multiturn.message_text(100, "tool", 7, words_per_token=0.5)
    assert text.startswith("[tool 00000007] result:\n")
    assert len(text.split()) == 3 + 50
    assert multiturn.message_text(100, "tool", 7, 0.5) == text != multiturn.message_text(100, "tool", 8, 0.5)


def turn(session: str, n: int, *, ok: bool = True, prompt: int = 100, out: int = 10, ttft: float = 0.1) -> Any:
    rec = ClientRecord(index=n, request_id=f"{session}-{n}", ok=ok, prompt_tokens=prompt, output_tokens=out)
    rec.ttft_s = ttft
    return multiturn.TurnRecord(session, n, rec, answer=f"{session}{n}")


def test_ideal_reuse_is_the_previous_prompt_and_answer_capped_at_the_prompt() -> None:
    records = [turn("a", 1, prompt=100), turn("a", 2, prompt=200), turn("a", 3, prompt=50), turn("b", 1)]
    assert multiturn.ideal_reusable(records) == 110 + 50


def test_a_failed_turn_is_not_reusable() -> None:
    assert multiturn.ideal_reusable([turn("a", 1, ok=False), turn("a", 2)]) == 0


def test_by_turn_splits_ttft_by_turn_index() -> None:
    figures = multiturn.by_turn([turn("a", 1, ttft=1.0), turn("a", 2, ttft=0.2), turn("b", 2, ttft=0.4)])
    assert figures["ttft_ms_by_turn"]["1"]["p50"] == pytest.approx(1000)
    assert figures["ttft_ms_turn2plus"]["p50"] == pytest.approx(300)
    assert figures["turns_ok"] == 3 and figures["turns_failed"] == 0


def test_answers_agree_compares_turns_both_runs_completed() -> None:
    a = [turn("a", 1), turn("a", 2)]
    b = [turn("a", 1), turn("a", 2, ok=False)]
    b[0].answer = "a1"
    assert multiturn.answers_agree(a, b) == (1, 1)


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_send_turn_collects_text_usage_and_cached_tokens() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["headers"] = dict(request.headers)
        chunks = [{"choices": [{"delta": {"content": piece}}]} for piece in ("Hel", "lo")]
        usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
        return httpx.Response(200, content=sse(*chunks, {"choices": [], "usage": usage}))

    async def go() -> tuple[ClientRecord, str, int | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            rec = ClientRecord(index=0, request_id="s-t1")
            ticks = iter(range(100))
            return await multiturn.send_turn(
                client, "http://x/v1/chat/completions", {}, {"X-Session-ID": "s"}, rec, lambda: next(ticks), 5.0, 2
            )

    rec, text, cached = asyncio.run(go())
    assert (rec.ok, text, cached, rec.prompt_tokens) == (True, "Hello", 32, 40)
    assert seen["headers"]["x-session-id"] == "s"


def test_send_turn_records_an_http_error() -> None:
    async def go() -> ClientRecord:
        transport = httpx.MockTransport(lambda _: httpx.Response(503, content=b"busy"))
        async with httpx.AsyncClient(transport=transport) as client:
            rec = ClientRecord(index=0, request_id="s-t1")
            got, _, _ = await multiturn.send_turn(client, "http://x/", {}, {}, rec, lambda: 0.0, 5.0, 2)
            return got

    rec = asyncio.run(go())
    assert not rec.ok and rec.error == "HTTP 503: busy"


def test_the_suite_plans_fit_the_issue_and_its_engines() -> None:
    from pathlib import Path

    from loadtest.bench.suites import multiturn as suite

    shape = suite.FULL.shape()
    assert (shape.turns, shape.message_tokens, shape.answer_tokens) == ((6, 10), (50, 500), (32, 128))
    assert suite.SMOKE.sessions < suite.FULL.sessions
    family = suite.engine_family(suite.FULL, Path("/m"))
    specs = family.specs
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    assert [s.name for s in family.decodes] == ["mt-d0", "mt-d1"] and family.prefills[0].engine_id == "mt-p0"
    assert all(suite.DETAILS in s.extra_args and s.connector == "KvpushConnector" for s in specs)  # the product's
    assert suite.FULL.turns_max * (suite.FULL.message_max + suite.FULL.answer_max) <= specs[0].max_model_len
    plan = suite.MultiTurnPlan(sessions=1, session_rate=1.0, decider_options=(("bypass_max_uncached_tokens", 128),))
    assert suite.decider_yaml(plan) == "decider:\n  name: session-affinity\n  bypass_max_uncached_tokens: 128\n"
    assert suite.decider_yaml(plan, 128).endswith("  block_tokens: 128\n")
    pinned = suite.MultiTurnPlan(sessions=1, session_rate=1.0, decider_options=(("block_tokens", 16),))
    assert suite.decider_yaml(pinned, 128).endswith("  block_tokens: 16\n")
    assert suite.decider_yaml(plan, 128, Path("/m/bench")).endswith('  block_tokens: 128\n  tokenizer: "/m/bench"\n')
    assert suite.MultiTurnPlan(sessions=2, session_rate=1.0, system_shared=True).shape().system_shared


def test_a_shared_system_prompt_is_one_text_for_every_session() -> None:
    shared = multiturn.plan_sessions(multiturn.SessionShape(4, 1.0, system_tokens=300, seed=3, system_shared=True))
    assert {s.system_seed for s in shared} == {3} and all(s.system_tokens == 300 for s in shared)
    own = multiturn.plan_sessions(multiturn.SessionShape(4, 1.0, system_tokens=300, seed=3))
    assert {s.system_seed for s in own} == {None}  # each session's own text, seeded by its id


def test_each_turn_goes_to_another_replica_and_sessions_start_on_each() -> None:
    targets = [multiturn.Target(f"http://r{i}", "tiny", 0.7) for i in range(2)]
    for session in range(4):
        seq = [multiturn.turn_target(targets, session, turn).base_url for turn in range(1, 7)]
        assert all(a != b for a, b in itertools.pairwise(seq)), seq
    firsts = {multiturn.turn_target(targets, session, 1).base_url for session in range(4)}
    assert firsts == {"http://r0", "http://r1"}
    one = targets[:1]
    assert {multiturn.turn_target(one, s, t).base_url for s in range(3) for t in range(1, 4)} == {"http://r0"}


def test_both_apis_alternate_by_session_and_a_burst_arrives_at_once() -> None:
    sessions = multiturn.plan_sessions(multiturn.SessionShape(6, 0.5, seed=2, api="both", burst=3))
    assert [s.api for s in sessions] == ["chat", "completions"] * 3
    assert len({s.start_s for s in sessions[:3]}) == 1 and len({s.start_s for s in sessions[3:]}) == 1
    assert sessions[3].start_s > sessions[0].start_s
    assert {s.api for s in multiturn.plan_sessions(multiturn.SessionShape(3, 1.0))} == {"chat"}
    with pytest.raises(ValueError, match="api"):
        multiturn.SessionShape(1, 1.0, api="responses")
    with pytest.raises(ValueError, match="burst"):
        multiturn.SessionShape(1, 1.0, burst=0)


def test_a_completions_turn_extends_the_previous_prompt_by_the_answer_as_received() -> None:
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    path, first = multiturn.turn_request("completions", "tiny", history, 8)
    assert path == "/v1/completions" and "messages" not in first
    assert first["prompt"] == "System: S\n\nUser: hi\n\nAssistant:"
    history += [{"role": "assistant", "content": " hello"}, {"role": "user", "content": "more"}]
    _, second = multiturn.turn_request("completions", "tiny", history, 8)
    assert second["prompt"] == first["prompt"] + " hello\n\nUser: more\n\nAssistant:"
    path, chat = multiturn.turn_request("chat", "tiny", history, 8)
    assert path == "/v1/chat/completions" and chat["messages"] == history and "prompt" not in chat
    assert chat["stream_options"] == {"include_usage": True} and chat["max_tokens"] == 8


def test_a_completions_stream_is_read_from_its_text() -> None:
    got = multiturn._Answer()
    got.feed('data: {"choices": [{"text": " a"}]}')
    got.feed('data: {"choices": [{"delta": {"content": "b"}}]}')
    got.feed("data: [DONE]")
    assert "".join(got.pieces) == " ab"
