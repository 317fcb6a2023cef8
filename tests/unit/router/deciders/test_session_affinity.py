"""The session-affinity decider: bypass on a short uncached suffix, decode by affinity, prefill by cached prefix."""

from __future__ import annotations

from typing import Any

import pytest

from router.decider import (
    AnswerCheck,
    DeciderStats,
    Decision,
    NoDecider,
    Outcome,
    Route,
    Turn,
    matched_tokens,
    stats_of,
)
from router.deciders.registry import REGISTRY, make_decider
from router.deciders.session_affinity import AffinityOptions, SessionAffinity
from router.domain import Endpoint, Mode, RequestInfo, WorkerView
from router.errors import ConfigError

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}  # ~600 chars
QUESTION = {"role": "user", "content": "Explain prefix caching in vLLM. " * 10}
ANSWER = "It reuses the KV of a shared prompt prefix. " * 8
SHORT = {"role": "user", "content": "Thanks, and in P/D?"}
LONG = {"role": "user", "content": "Here is a long tool result. " * 80}  # ~2240 chars: ~560 tokens


def views(*ids: str, busy: dict[str, int] | None = None, waiting: dict[str, int] | None = None) -> list[WorkerView]:
    busy, waiting = busy or {}, waiting or {}
    return [
        WorkerView(
            id=i,
            in_flight=busy.get(i, 0),
            outstanding_tokens=0,
            engine_waiting=waiting.get(i, 0),
            load_known=i in waiting,
        )
        for i in ids
    ]


DECODES = views("d1", "d2")
PREFILLS = views("p1", "p2")


def turn(
    *messages: dict[str, Any], session: str | None = None, mode: Mode = Mode.PUSH, endpoint: Endpoint = Endpoint.CHAT
) -> Turn:
    body: dict[str, Any] = {"model": "m", "max_tokens": 64}
    if endpoint is Endpoint.CHAT:
        body["messages"] = list(messages)
    else:
        body["prompt"] = "".join(str(m["content"]) for m in messages)
    headers = {"x-session-id": session} if session else {}
    return Turn(RequestInfo(endpoint, True, 100), body, headers, mode)


def served(
    decider: SessionAffinity,
    t: Turn,
    decision: Decision,
    *,
    decode: str = "d1",
    prefill: str | None = "p1",
    prompt_tokens: int = 400,
    cached: int | None = None,
    answer: str | None = ANSWER,
    completion_tokens: int = 97,  # 96 of them fed back: the last sampled token has no KV
    ok: bool = True,
    now: float = 1.0,
    ids: tuple[int, ...] | None = None,
) -> AnswerCheck | None:
    outcome = Outcome(ok, decode, prefill, prompt_tokens, cached, completion_tokens, answer, ids)
    return decider.record(t, decision, outcome, now)


def first_turn(decider: SessionAffinity, session: str | None = None, **kw: Any) -> Turn:
    """Turn 1 (system + question) served by push on d1/p1, answered with ANSWER."""
    t = turn(SYSTEM, QUESTION, session=session)
    decision = decider.decide(t, DECODES, PREFILLS, 0.0)
    served(decider, t, decision, **kw)
    return t


def second(*new: dict[str, Any], answer: str = ANSWER, session: str | None = None) -> Turn:
    return turn(SYSTEM, QUESTION, {"role": "assistant", "content": answer}, *new, session=session)


def test_registered_and_built_from_options() -> None:
    assert "session-affinity" in REGISTRY
    decider = make_decider("session-affinity", {"name": "session-affinity", "bypass_max_uncached_tokens": 128})
    assert isinstance(decider, SessionAffinity) and decider.wants_answer
    assert decider.options.bypass_max_uncached_tokens == 128


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bypass_tokens": 3}, "unknown option"),
        ({"bypass_max_uncached_tokens": "25.6"}, "bypass_max_uncached_tokens: expected an integer"),
        ({"bypass_max_uncached_tokens": True}, "expected an integer"),
        ({"bypass_max_uncached_tokens": -1}, r"out of range \[0, inf\]"),
        ({"ttl_s": 0}, "positive"),
        ({"ttl_s": float("inf")}, "positive"),
        ({"chars_per_token": "four"}, "chars_per_token: expected a number"),
        ({"chars_per_token": 0}, "positive"),
        ({"overload_in_flight_gap": 0}, r"out of range \[1, inf\]"),
        ({"max_sessions": 0}, r"out of range \[1, inf\]"),
        ({"verify_answers": "yes"}, "true or false"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_decider("session-affinity", options)


def test_options_accept_ints_for_floats() -> None:
    assert AffinityOptions.from_mapping({"ttl_s": 120, "chars_per_token": 3}).ttl_s == 120


def test_options_follow_the_value_rules_of_every_setting() -> None:
    """router/values.py's rules, as for the policies: numbers may come as strings (environment, flags)."""
    parsed = AffinityOptions.from_mapping({"bypass_max_uncached_tokens": "256", "chars_per_token": "4"})
    assert (parsed.bypass_max_uncached_tokens, parsed.chars_per_token) == (256, 4.0)


def test_a_first_turn_is_pushed_and_the_policies_pick() -> None:
    decider = SessionAffinity()
    decision = decider.decide(turn(SYSTEM, QUESTION), DECODES, PREFILLS, 0.0)
    assert (decision.route, decision.decode, decision.prefill, decision.predicted_cached_tokens) == (
        Route.PUSH,
        None,
        None,
        0,
    )


def test_a_first_turn_in_pull_mode_is_pulled() -> None:
    decision = SessionAffinity().decide(turn(SYSTEM, QUESTION, mode=Mode.PULL), DECODES, PREFILLS, 0.0)
    assert decision.route is Route.PULL


def test_a_short_next_turn_bypasses_prefill_on_the_decode_that_holds_the_history() -> None:
    decider = SessionAffinity()
    first_turn(decider, decode="d2")
    decision = decider.decide(second(SHORT), DECODES, PREFILLS, 2.0)
    assert decision.route is Route.BYPASS
    assert (decision.decode, decision.prefill) == ("d2", None)
    assert decision.predicted_cached_tokens == 400 + 96  # turn 1's prompt and answer, less the last token


def test_a_long_next_turn_is_pushed_to_the_same_decode_and_the_warm_prefill() -> None:
    decider = SessionAffinity()
    first_turn(decider, decode="d2", prefill="p2")
    decision = decider.decide(second(LONG), DECODES, PREFILLS, 2.0)
    assert decision.route is Route.PUSH
    assert (decision.decode, decision.prefill) == ("d2", "p2")
    assert decision.predicted_cached_tokens == 496


def test_only_whole_blocks_count_as_cached() -> None:
    decider = SessionAffinity(AffinityOptions(block_tokens=128))
    first_turn(decider)  # decode holds 400 + 96 tokens: three whole blocks of 128
    decision = decider.decide(second(SHORT), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.predicted_cached_tokens) == (Route.BYPASS, 384)
    assert decision.state.predicted_uncached > 496 - 384  # the partial block is recomputed too


def test_the_threshold_is_an_option() -> None:
    decider = SessionAffinity(AffinityOptions(bypass_max_uncached_tokens=2000))
    first_turn(decider)
    assert decider.decide(second(LONG), DECODES, PREFILLS, 2.0).route is Route.BYPASS


def test_an_answer_sent_back_altered_credits_only_the_earlier_prompt() -> None:
    decider = SessionAffinity()
    first_turn(decider)
    decision = decider.decide(second(SHORT, answer=ANSWER.strip()), DECODES, PREFILLS, 2.0)
    assert decision.decode == "d1"
    assert decision.predicted_cached_tokens == 400  # the prompt, not the answer: the text differs
    assert decision.route is Route.BYPASS  # ~100 uncached tokens (the answer and SHORT) are still a short suffix


def test_without_the_answer_text_only_the_prompt_is_credited() -> None:
    decider = SessionAffinity()
    first_turn(decider, answer=None)
    assert decider.decide(second(SHORT), DECODES, PREFILLS, 2.0).predicted_cached_tokens == 400


def test_an_edited_history_is_credited_only_up_to_the_edit() -> None:
    decider = SessionAffinity(AffinityOptions(bypass_max_uncached_tokens=100))
    first_turn(decider)
    edited = turn(SYSTEM, {"role": "user", "content": "Explain it."}, {"role": "assistant", "content": ANSWER}, SHORT)
    decision = decider.decide(edited, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.PUSH, "d1")  # the rest (~170 tokens) is over 100
    system_only = decider.decide(turn(SYSTEM, SHORT), DECODES, PREFILLS, 2.0).predicted_cached_tokens
    assert decision.predicted_cached_tokens == system_only and 0 < system_only < 400


def test_an_unhealthy_preferred_decode_is_not_chosen() -> None:
    decider = SessionAffinity()
    first_turn(decider, session="s")
    decision = decider.decide(second(SHORT, session="s"), views("d2"), PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.PUSH, None)


def test_an_overloaded_preferred_decode_is_not_chosen() -> None:
    decider = SessionAffinity(AffinityOptions(overload_in_flight_gap=4))
    first_turn(decider)
    assert decider.decide(second(SHORT), views("d1", "d2", busy={"d1": 3}), PREFILLS, 2.0).decode == "d1"
    busy = decider.decide(second(SHORT), views("d1", "d2", busy={"d1": 4}), PREFILLS, 2.0)
    assert (busy.route, busy.decode) == (Route.PUSH, None)
    queued = decider.decide(second(SHORT), views("d1", "d2", waiting={"d1": 8, "d2": 0}), PREFILLS, 2.0)
    assert queued.decode is None


def test_when_every_decode_is_overloaded_none_is_skipped() -> None:
    decider = SessionAffinity()
    first_turn(decider)
    decision = decider.decide(second(SHORT), views("d1", waiting={"d1": 50}), PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d1")


def test_a_session_sticks_to_its_decode_even_when_nothing_matches() -> None:
    decider = SessionAffinity()
    first_turn(decider, session="s", decode="d2")
    other = turn({"role": "user", "content": "unrelated"}, session="s")
    decision = decider.decide(other, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.PUSH, "d2", 0)


def test_the_body_prompt_cache_key_is_a_session_too() -> None:
    decider = SessionAffinity()
    t = turn(SYSTEM, QUESTION)
    body = dict(t.body, prompt_cache_key="k")
    keyed = Turn(t.info, body, {}, t.mode)
    served(decider, keyed, decider.decide(keyed, DECODES, PREFILLS, 0.0), decode="d2")
    other = Turn(t.info, {"model": "m", "messages": [SHORT], "prompt_cache_key": "k"}, {}, t.mode)
    assert decider.decide(other, DECODES, PREFILLS, 2.0).decode == "d2"


def test_a_worker_holding_more_beats_the_session_affinity() -> None:
    decider = SessionAffinity()
    first_turn(decider, session="s", decode="d1")
    t = turn({"role": "user", "content": "unrelated"}, session="s")
    served(decider, t, decider.decide(t, DECODES, PREFILLS, 1.0), decode="d2", now=1.5)  # the session moved to d2
    decision = decider.decide(second(SHORT, session="s"), DECODES, PREFILLS, 2.0)
    assert decision.decode == "d1"  # d1 holds the history; d2 only the unrelated turn


def test_forgetting_a_worker_drops_its_prefixes_and_sessions() -> None:
    decider = SessionAffinity()
    first_turn(decider, session="s")
    decider.forget("d1")
    decider.forget("p1")
    decision = decider.decide(second(SHORT, session="s"), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode, decision.prefill) == (Route.PUSH, None, None)


def test_held_prefixes_age_out_after_the_ttl() -> None:
    decider = SessionAffinity(AffinityOptions(ttl_s=30))
    first_turn(decider, now=1.0)
    assert decider.decide(second(SHORT), DECODES, PREFILLS, 30.9).route is Route.BYPASS
    assert decider.decide(second(SHORT), DECODES, PREFILLS, 31.0).route is Route.PUSH


def test_a_failed_attempt_teaches_nothing() -> None:
    decider = SessionAffinity()
    first_turn(decider, ok=False, session="s")
    decision = decider.decide(second(SHORT, session="s"), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.PUSH, None)
    assert stats(decider).index_links == {"decode": 0, "prefill": 0}


def test_a_bypassed_turn_is_recorded_on_decode_only() -> None:
    decider = SessionAffinity()
    first_turn(decider)
    t2 = second(SHORT)
    decision = decider.decide(t2, DECODES, PREFILLS, 2.0)
    served(decider, t2, decision, prefill=None, prompt_tokens=528, cached=480, now=3.0)
    t3 = turn(*t2.body["messages"], {"role": "assistant", "content": ANSWER}, SHORT)
    third = decider.decide(t3, DECODES, PREFILLS, 4.0)
    assert (third.route, third.decode, third.predicted_cached_tokens) == (Route.BYPASS, "d1", 528 + 96)
    assert stats(decider).index_links["prefill"] == 3  # turn 1's links only


def test_the_ratio_is_learned_from_reported_prompt_tokens() -> None:
    decider = SessionAffinity(AffinityOptions(chars_per_token=4.0))
    t = first_turn(decider, prompt_tokens=100)
    assert decider.ratio.samples == 1
    assert decider.ratio.value == pytest.approx(100 / _chars(t))


def test_completions_turns_bypass_too() -> None:
    decider = SessionAffinity()
    t1 = turn(SYSTEM, QUESTION, endpoint=Endpoint.COMPLETIONS)
    served(decider, t1, decider.decide(t1, DECODES, PREFILLS, 0.0), decode="d2")
    t2 = turn(SYSTEM, QUESTION, {"content": ANSWER}, SHORT, endpoint=Endpoint.COMPLETIONS)
    decision = decider.decide(t2, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d2")
    assert 400 < decision.predicted_cached_tokens <= 496  # whole chunks only


def test_stats_count_decisions_index_and_prediction_accuracy() -> None:
    decider = SessionAffinity()
    first_turn(decider, session="s")
    t2 = second(SHORT, session="s")
    decision = decider.decide(t2, DECODES, PREFILLS, 2.0)
    plan_uncached = decision.state.predicted_uncached
    served(decider, t2, decision, prefill=None, prompt_tokens=496 + plan_uncached, cached=496, now=3.0)
    t3 = second(SHORT, session="s")
    far = decider.decide(t3, DECODES, PREFILLS, 4.0)
    served(decider, t3, far, prefill=None, prompt_tokens=496 + 10 * plan_uncached, cached=496, now=5.0)
    s = stats(decider)
    assert s.decisions["push"] == 1 and s.decisions["bypass"] == 2 and s.decisions["fallback"] == 0
    assert s.sessions == 1 and s.index_links["decode"] > 0
    assert s.checked_bypasses == 2 and s.accurate_bypasses == 1
    assert s.predicted_cached_tokens == 496 + (496 + plan_uncached) // 16 * 16  # t3 repeats t2: t2's prompt is held
    assert s.actual_cached_tokens == 2 * 496
    assert s.evictions["decode/capacity"] == 0 and "sessions/forgotten" in s.evictions


@pytest.mark.parametrize(
    "garbled",
    ["\ufffd" + ANSWER, "***"],  # not valid UTF-8 from the start; 97 tokens for 3 bytes (tokens it does not show)
)
def test_an_answer_that_cannot_re_tokenize_as_generated_is_matched_but_not_credited(garbled: str) -> None:
    decider = SessionAffinity()
    first_turn(decider, answer=garbled)
    decision = decider.decide(second(SHORT, answer=garbled), DECODES, PREFILLS, 2.0)
    assert decision.decode == "d1"  # the history still points at the decode that served it
    assert decision.predicted_cached_tokens == 400  # the prompt's blocks only
    assert decision.state.predicted_uncached >= 97  # the answer's tokens are recomputed with the new message
    trusted = SessionAffinity()
    first_turn(trusted)
    plain = trusted.decide(second(SHORT), DECODES, PREFILLS, 2.0)
    assert plain.state.predicted_uncached < decision.state.predicted_uncached


def test_push_outcomes_are_not_checked_against_decode_usage() -> None:
    decider = SessionAffinity()
    first_turn(decider, cached=400)  # push: decode counts transferred tokens as cached
    assert stats(decider).checked_bypasses == 0


def test_none_is_exactly_the_configured_mode_and_keeps_no_stats() -> None:
    none = make_decider("none")
    assert isinstance(none, NoDecider) and not none.wants_answer
    for mode, route in ((Mode.PUSH, Route.PUSH), (Mode.PULL, Route.PULL)):
        assert none.decide(turn(SYSTEM, mode=mode), DECODES, PREFILLS, 0.0) == Decision(route)
    assert stats_of(none) is None


def stats(decider: SessionAffinity) -> DeciderStats:
    found = stats_of(decider)
    assert found is not None
    return found


def _chars(t: Turn) -> int:
    from router.deciders.conversation import chain_of

    return chain_of(t.info.endpoint, t.body).chars


def test_answers_stop_being_credited_when_bypasses_find_them_uncached() -> None:
    """The strict-prefix trap seen from outside: the relayed text is not what decode cached (e.g. reasoning the
    relay did not show), so bypasses find only the earlier prompt cached. After enough such misses the decider
    credits prompts only."""
    decider = SessionAffinity()
    for i in range(4):
        first_turn(decider, now=float(i))
        t2 = second(SHORT)
        decision = decider.decide(t2, DECODES, PREFILLS, i + 0.5)
        assert decision.route is Route.BYPASS and decision.predicted_cached_tokens >= 496
        served(decider, t2, decision, prefill=None, prompt_tokens=528, cached=200, now=i + 0.6)
    assert not decider.answers_trusted and not stats(decider).answers_trusted
    fresh = SessionAffinity()
    fresh.answers_trusted = False
    first_turn(fresh)
    assert fresh.decide(second(SHORT), DECODES, PREFILLS, 2.0).predicted_cached_tokens == 400


def test_accurate_bypasses_keep_answers_credited() -> None:
    decider = SessionAffinity()
    for i in range(6):
        first_turn(decider, now=float(i))
        t2 = second(SHORT)
        decision = decider.decide(t2, DECODES, PREFILLS, i + 0.5)
        served(decider, t2, decision, prefill=None, prompt_tokens=528, cached=480, now=i + 0.6)
    assert decider.answers_trusted


def test_the_none_decider_refuses_options() -> None:
    from router.errors import ConfigError

    with pytest.raises(ConfigError, match="takes no options"):
        make_decider("none", {"bypass_max_uncached_tokens": 256})


GENERATED = tuple(range(1000, 1097))  # ANSWER's 97 generated token ids


def checked_first_turn(decider: SessionAffinity, **kw: Any) -> AnswerCheck:
    t = turn(SYSTEM, QUESTION)
    check = served(decider, t, decider.decide(t, DECODES, PREFILLS, 0.0), ids=GENERATED, **kw)
    assert check is not None
    return check


def test_an_answer_with_its_token_ids_is_handed_back_for_a_check() -> None:
    decider = SessionAffinity()
    assert decider.wants_token_ids
    check = checked_first_turn(decider, decode="d2")
    assert (check.worker, check.text, check.generated) == ("d2", ANSWER, GENERATED)


@pytest.mark.parametrize(
    ("matched", "cached"),
    [(96, 400 + 96), (48, 400 + 48), (0, 400)],  # re-tokenizes as generated; diverges at token 48; at once
)
def test_a_settled_check_makes_the_credit_exactly_what_re_tokenizes(matched: int, cached: int) -> None:
    decider = SessionAffinity()
    check = checked_first_turn(decider)
    check.settle(matched, 97, 1.5)
    decision = decider.decide(second(SHORT), DECODES, PREFILLS, 2.0)
    assert decision.predicted_cached_tokens == cached
    s = stats(decider)
    assert (s.answers_checked, s.answers_short) == (1, int(matched < 96))


def test_a_check_can_credit_more_than_the_first_estimate() -> None:
    garbled = ANSWER[:100] + "\ufffd" + ANSWER[100:]  # the estimate stops at the U+FFFD
    decider = SessionAffinity()
    t = turn(SYSTEM, QUESTION)
    check = served(decider, t, decider.decide(t, DECODES, PREFILLS, 0.0), answer=garbled, ids=GENERATED)
    assert check is not None
    before = decider.decide(second(SHORT, answer=garbled), DECODES, PREFILLS, 2.0).predicted_cached_tokens
    check.settle(96, 97, 1.5)
    after = decider.decide(second(SHORT, answer=garbled), DECODES, PREFILLS, 2.0).predicted_cached_tokens
    assert before < after == 400 + 96


def test_a_late_check_does_not_lower_what_a_later_turn_recorded() -> None:
    decider = SessionAffinity()
    check = checked_first_turn(decider)
    t2 = second(SHORT)
    served(decider, t2, decider.decide(t2, DECODES, PREFILLS, 2.0), prefill=None, prompt_tokens=520, now=3.0)
    check.settle(0, 97, 4.0)  # turn 2 sent the answer as prompt: decode computed it, so it is cached whole
    t3 = turn(SYSTEM, QUESTION, {"role": "assistant", "content": ANSWER}, SHORT)
    assert decider.decide(t3, DECODES, PREFILLS, 5.0).predicted_cached_tokens >= 496


@pytest.mark.parametrize(
    ("kw", "options"),
    [
        ({"ids": None}, {}),  # decode sent no ids
        ({"ids": GENERATED[:50]}, {}),  # fewer ids than usage counts: not the whole answer
        ({"ids": GENERATED}, {"verify_answers": False}),
        ({"ids": GENERATED, "answer": None}, {}),
        ({"ids": GENERATED, "ok": False}, {}),
    ],
)
def test_no_check_without_whole_ids_or_when_turned_off(kw: dict[str, Any], options: dict[str, Any]) -> None:
    decider = SessionAffinity(AffinityOptions.from_mapping(options))
    t = turn(SYSTEM, QUESTION)
    assert served(decider, t, decider.decide(t, DECODES, PREFILLS, 0.0), **kw) is None
    assert decider.wants_token_ids is options.get("verify_answers", True)


@pytest.mark.parametrize(
    ("generated", "retokenized", "matched"),
    [
        ((1, 2, 3, 4), (1, 2, 3, 4), 3),  # all but the last sampled token
        ((1, 2, 3, 4), (1, 2, 9, 4), 2),
        ((1, 2, 3, 4), (7, 2, 3, 4), 0),
        ((1, 2, 3, 4), (1, 2), 2),  # the text re-tokenizes to fewer tokens
        ((1,), (1,), 0),
        ((), (1, 2), 0),
    ],
)
def test_matched_tokens(generated: tuple[int, ...], retokenized: tuple[int, ...], matched: int) -> None:
    assert matched_tokens(generated, retokenized) == matched


def test_a_check_places_the_answer_where_its_text_re_tokenizes_to() -> None:
    decider = SessionAffinity()
    check = checked_first_turn(decider)
    before = decider.decide(second(SHORT), DECODES, PREFILLS, 2.0).state.predicted_uncached
    check.settle(96, 107, 1.5)  # the text re-tokenizes to 10 more tokens than were generated
    after = decider.decide(second(SHORT), DECODES, PREFILLS, 2.0)
    assert after.predicted_cached_tokens == 400 + 96
    assert after.state.predicted_uncached == before + 10  # they are in the prompt, past what is cached


def test_the_suffix_is_estimated_from_what_turns_added_beyond_their_held_prefix() -> None:
    decider = SessionAffinity()
    first_turn(decider)  # 400 prompt + 97 generated tokens held
    t2 = second(LONG)
    decision = decider.decide(t2, DECODES, PREFILLS, 2.0)
    added_chars = _chars(t2) - decision.state.held.chars
    served(decider, t2, decision, prompt_tokens=497 + added_chars // 4, now=3.0)  # 4 chars per added token
    assert decider.suffix_ratio.value == pytest.approx(0.25, abs=0.01)
    assert decider.ratio.value > 0.4  # the whole prompts' ratio is another (turn 1: 400 tokens, ~880 chars)
    t3 = turn(
        SYSTEM, QUESTION, {"role": "assistant", "content": ANSWER}, LONG, {"role": "assistant", "content": "ok"}, SHORT
    )
    predicted = decider.decide(t3, DECODES, PREFILLS, 4.0).state.predicted_uncached
    assert predicted == pytest.approx(0.25 * (_chars(t3) - _chars(t2)) + 1, abs=4)
