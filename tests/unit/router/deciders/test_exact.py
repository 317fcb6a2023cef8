"""Deciding on exact prompt ids: the longest run of the prompt's own blocks the engines' KV events report, the
same on every replica; a shared system prompt found on a session's first turn. Real index, view and tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.decider import Outcome, Route, Turn
from router.deciders.exact import exact_pick, served_from_cache
from router.deciders.prompt_tokens import PromptTokens
from router.deciders.session_affinity import AffinityOptions, SessionAffinity
from router.domain import Endpoint, Mode, RequestInfo, WorkerView
from router.kv_events.frames import Stored
from router.kv_events.index import KvIndex
from router.kv_events.stream import StreamStatus
from router.kv_events.view import KvEventView
from tests.unit.router.deciders.test_prompt_tokens import corpus, folder

BLOCK = 16
DECODES = [WorkerView(id=i, in_flight=0, outstanding_tokens=0) for i in ("d1", "d2")]
PREFILLS = [WorkerView(id=i, in_flight=0, outstanding_tokens=0) for i in ("p1", "p2")]


class Engines:
    def __init__(self, up: tuple[str, ...] = ("d1", "d2", "p1", "p2")) -> None:
        self.index = KvIndex(10_000)
        self.up = set(up)
        self.view = KvEventView(self.index, self.status)
        self._next = 1

    def status(self, worker: str) -> list[StreamStatus]:
        return [StreamStatus(worker, 0, "in_sync", True, True, 0, 0, 0)] if worker in self.up else []

    def store(self, worker: str, ids: list[int], session: str | None = None) -> None:
        """The engine stored the whole blocks of `ids` (a prompt, or a prompt and its answer), chained from root."""
        blocks = len(ids) // BLOCK
        hashes = tuple(range(self._next, self._next + blocks))
        self._next += blocks
        event = Stored(hashes, None, tuple(ids[: blocks * BLOCK]), BLOCK, None, None, False, session)
        self.index.stream(worker, 0).apply([event])


def ids(n: int, start: int = 100) -> list[int]:
    return [start + i for i in range(n)]


def test_cache_serves_whole_blocks_before_the_last_token() -> None:
    assert served_from_cache(80, 80, BLOCK) == 64  # held whole: the last block is computed again
    assert served_from_cache(64, 81, BLOCK) == 64
    assert served_from_cache(32, 200, BLOCK) == 32
    assert served_from_cache(0, 0, BLOCK) == 0


def test_the_longest_holder_is_picked_and_its_cache_counted_exactly() -> None:
    engines = Engines()
    prompt = ids(100)
    engines.store("d1", prompt[:32])
    engines.store("d2", prompt[:80])
    engines.store("p2", prompt[:48])
    pick = exact_pick(engines.view, prompt, ["d1", "d2"], ["p1", "p2"])
    assert pick is not None
    assert (pick.decode, pick.held, pick.cached, pick.uncached, pick.prefill) == ("d2", 80, 80, 20, "p2")
    other = exact_pick(engines.view, [1, *prompt[1:]], ["d1", "d2"], ["p1", "p2"])  # another first token
    assert other is not None and (other.decode, other.cached, other.prefill) == (None, 0, None)


def test_a_view_not_caught_up_leaves_the_decision_to_the_estimate() -> None:
    engines = Engines(up=("d1", "p1"))
    assert exact_pick(engines.view, ids(40), ["d1", "d2"], ["p1"]) is None
    engines.store("p1", ids(40))
    pick = exact_pick(engines.view, ids(40), ["d1"], ["p1", "p2"])
    assert pick is not None and pick.prefill is None  # p2 lags: it might hold more


@pytest.fixture
def tokens(tmp_path: Path) -> PromptTokens:
    return PromptTokens.load(str(folder(tmp_path)))


def chat(messages: list[dict[str, str]], session: str) -> Turn:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    return Turn(RequestInfo(Endpoint.CHAT, True, 100), body, {"x-session-id": session}, Mode.PUSH)


def replica(engines: Engines, tokens: PromptTokens) -> SessionAffinity:
    return SessionAffinity(
        AffinityOptions(block_tokens=BLOCK, bypass_max_uncached_tokens=64), engines.view, None, tokens
    )


def test_a_shared_system_prompt_is_found_on_a_sessions_first_turn_on_any_replica(tokens: PromptTokens) -> None:
    engines = Engines()
    system = {"role": "system", "content": corpus(3, 200)}
    first = chat([system, {"role": "user", "content": corpus(4, 30)}], "a")
    engines.store("d2", tokens.of(Endpoint.CHAT, first.body) or [], "a")  # session a's first turn, served on d2
    second = chat([system, {"role": "user", "content": "the fox"}], "b")  # another session, same system prompt
    prompt = tokens.of(Endpoint.CHAT, second.body)
    assert prompt is not None
    shared = next(
        i for i, (x, y) in enumerate(zip(prompt, tokens.of(Endpoint.CHAT, first.body) or [], strict=False)) if x != y
    )
    for d in (replica(engines, tokens), replica(engines, tokens)):  # two fresh replicas: the same decision
        decision = d.decide(second, DECODES, PREFILLS, 1.0)
        assert (decision.route, decision.decode) == (Route.BYPASS, "d2")
        assert decision.predicted_cached_tokens == shared // BLOCK * BLOCK
        assert d.stats().event_decisions == 1


def test_a_later_turn_bypasses_where_the_engine_holds_the_turns_before_it(tokens: PromptTokens) -> None:
    engines = Engines()
    history = [{"role": "user", "content": corpus(5, 120)}]
    turn1 = tokens.of(Endpoint.CHAT, {"messages": history}) or []
    answer = corpus(6, 20)
    answer_ids = tokens.of(Endpoint.COMPLETIONS, {"prompt": answer, "add_special_tokens": False}) or []
    engines.store("d1", [*turn1, *answer_ids], "s")  # the prompt and the answer, as decode filled the blocks
    later = chat([*history, {"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}], "s")
    d = replica(engines, tokens)
    decision = d.decide(later, DECODES, PREFILLS, 1.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d1")
    prompt = tokens.of(Endpoint.CHAT, later.body) or []
    plan = decision.state
    assert plan.predicted_uncached == len(prompt) - decision.predicted_cached_tokens
    outcome = Outcome(True, "d1", None, len(prompt), decision.predicted_cached_tokens, 5, "x")
    d.record(later, decision, outcome, 2.0)
    assert (d.stats().checked_bypasses, d.stats().accurate_bypasses) == (1, 1)


def test_nothing_held_pushes_to_the_sessions_last_decode(tokens: PromptTokens) -> None:
    engines = Engines()
    d = replica(engines, tokens)
    d.sessions.set("s", "d2", 0.0)
    decision = d.decide(chat([{"role": "user", "content": "hello"}], "s"), DECODES, PREFILLS, 1.0)
    assert (decision.route, decision.decode, decision.prefill, decision.predicted_cached_tokens) == (
        Route.PUSH,
        "d2",
        None,
        0,
    )


def test_a_shape_the_router_does_not_render_falls_back_to_the_estimate(tokens: PromptTokens) -> None:
    engines = Engines()
    d = replica(engines, tokens)
    image: dict[str, Any] = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    decision = d.decide(chat([image], "s"), DECODES, PREFILLS, 1.0)
    assert decision.route is Route.PUSH and "exact" not in decision.reason


def test_each_checked_bypass_is_logged_with_its_prediction_and_decodes_count(
    tokens: PromptTokens, caplog: pytest.LogCaptureFixture
) -> None:
    engines = Engines()
    history = [{"role": "user", "content": corpus(5, 120)}]
    engines.store("d1", tokens.of(Endpoint.CHAT, {"messages": history}) or [], "s")
    later = chat([*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}], "s")
    later = Turn(later.info, later.body, {**later.headers, "x-request-id": "r-7"}, later.mode)
    d = replica(engines, tokens)
    decision = d.decide(later, DECODES, PREFILLS, 1.0)
    assert decision.route is Route.BYPASS
    prompt = len(tokens.of(Endpoint.CHAT, later.body) or [])
    caplog.set_level("INFO", logger="kvpush.decider")
    d.record(later, decision, Outcome(True, "d1", None, prompt, decision.predicted_cached_tokens - BLOCK, 5), 2.0)
    (line,) = [r for r in caplog.records if r.getMessage().startswith("bypass checked")]
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["request_id"] == "r-7" and fields["exact"] is True and fields["decode"] == "d1"
    assert fields["predicted_uncached_tokens"] == prompt - decision.predicted_cached_tokens
    assert fields["computed_tokens"] == fields["predicted_uncached_tokens"] + BLOCK  # a block evicted meanwhile


def test_a_bypass_the_client_left_is_logged_but_not_counted(
    tokens: PromptTokens, caplog: pytest.LogCaptureFixture
) -> None:
    engines = Engines()
    history = [{"role": "user", "content": corpus(5, 120)}]
    engines.store("d1", tokens.of(Endpoint.CHAT, {"messages": history}) or [], "s")
    later = chat([*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}], "s")
    d = replica(engines, tokens)
    decision = d.decide(later, DECODES, PREFILLS, 1.0)
    prompt = len(tokens.of(Endpoint.CHAT, later.body) or [])
    caplog.set_level("INFO", logger="kvpush.decider")
    d.record(later, decision, Outcome(False, "d1", None, prompt, decision.predicted_cached_tokens, 5), 2.0)
    (line,) = [r for r in caplog.records if r.getMessage().startswith("bypass checked")]
    assert line.fields["ok"] is False  # type: ignore[attr-defined]
    assert d.stats().checked_bypasses == 0
