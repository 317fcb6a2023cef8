"""The session-affinity decider with the engines' KV events: a caught-up view judges what each worker holds; the
request-learned index stays the fallback. Real index and view (pure), fed vLLM-shaped BlockStored events."""

from __future__ import annotations

from typing import Any

from router.decider import Decision, Outcome, Route, Turn
from router.deciders.answer_align import align
from router.deciders.conversation import conversation_key
from router.deciders.session_affinity import AffinityOptions, SessionAffinity, prompt_token_ids
from router.domain import Endpoint, Mode, RequestInfo, WorkerView
from router.kv_events.frames import Cleared, Removed, Stored
from router.kv_events.index import KvIndex, SessionTail
from router.kv_events.stream import StreamStatus
from router.kv_events.view import KvEventView

BLOCK = 16
QUESTION = {"role": "user", "content": "Explain prefix caching in vLLM. " * 10}  # 320 chars
ANSWER = "It reuses the KV of a shared prompt prefix. " * 8
SHORT = {"role": "user", "content": "Thanks, and in P/D?"}
DECODES = [WorkerView(id=i, in_flight=0, outstanding_tokens=0) for i in ("d1", "d2")]
PREFILLS = [WorkerView(id=i, in_flight=0, outstanding_tokens=0) for i in ("p1", "p2")]


class Engines:
    """What the engines published, and whether each worker's view is caught up."""

    def __init__(self) -> None:
        self.index = KvIndex(10_000)
        self.up: set[str] = set()
        self.view = KvEventView(self.index, self.status)
        self._next = 1

    def status(self, worker: str) -> list[StreamStatus]:
        if worker not in self.up:
            return []
        return [StreamStatus(worker, 0, "in_sync", True, True, 0, 0, 0)]

    def store(self, worker: str, blocks: int, session: str | None, tokens: list[int] | None = None) -> None:
        ids = tokens if tokens is not None else [self._next * 1000 + i for i in range(blocks * BLOCK)]
        hashes = tuple(range(self._next, self._next + blocks))
        self._next += blocks
        self.up.add(worker)
        event = Stored(hashes, None, tuple(ids[: blocks * BLOCK]), BLOCK, None, None, False, session)
        self.index.stream(worker, 0).apply([event])


def decider(engines: Engines | None) -> SessionAffinity:
    return SessionAffinity(AffinityOptions(block_tokens=BLOCK), engines.view if engines else None)


def chat(*messages: dict[str, Any], session: str | None = "s") -> Turn:
    body = {"model": "m", "max_tokens": 64, "messages": list(messages)}
    return Turn(RequestInfo(Endpoint.CHAT, True, 100), body, {"x-session-id": session} if session else {}, Mode.PUSH)


def served(d: SessionAffinity, t: Turn, decision: Decision, decode: str, prompt_tokens: int) -> None:
    d.record(t, decision, Outcome(True, decode, "p1", prompt_tokens, None, 97, ANSWER), 1.0)


def test_a_turn_another_replica_served_is_bypassed_where_the_engine_holds_the_session() -> None:
    engines = Engines()
    engines.store("d2", 12, "s")  # turn 1, through another replica, left 192 tokens of the session on d2
    engines.store("d1", 20, "other")
    engines.up.add("p1")
    d = decider(engines)
    decision = d.decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.BYPASS, "d2", 192)
    stats = d.stats()
    assert (stats.event_decisions, stats.event_matches, stats.event_corrections) == (1, 1, 0)


def test_without_events_the_same_turn_on_a_fresh_replica_is_pushed() -> None:
    decision = decider(None).decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT), DECODES, [], 2.0)
    assert (decision.route, decision.decode) == (Route.PUSH, None)


def test_a_learned_prefix_the_engine_evicted_is_not_bypassed() -> None:
    engines = Engines()
    engines.store("d1", 30, "s")
    d = decider(engines)
    first = chat(QUESTION)
    served(d, first, d.decide(first, DECODES, PREFILLS, 1.0), "d1", 80)
    second = chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT)
    assert d.decide(second, DECODES, PREFILLS, 2.0).route is Route.BYPASS  # the engine confirms what was learned
    engines.index.stream("d1", 0).apply([Cleared()])  # reset_prefix_cache, or every block evicted
    decision = d.decide(second, DECODES, PREFILLS, 3.0)
    assert decision.route is Route.PUSH and decision.predicted_cached_tokens == 0
    assert d.stats().event_corrections == 1


def test_a_worker_whose_view_is_not_caught_up_keeps_the_learned_index() -> None:
    engines = Engines()
    d = decider(engines)
    first = chat(QUESTION)
    served(d, first, d.decide(first, DECODES, PREFILLS, 1.0), "d1", 80)
    second = chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT)
    assert engines.view.caught_up("d1") is False
    decision = d.decide(second, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d1")
    assert d.stats().event_decisions == 0


def test_a_partly_evicted_session_is_judged_by_what_is_left() -> None:
    engines = Engines()
    engines.store("d1", 10, "s")
    d = decider(engines)
    engines.index.stream("d1", 0).apply([Removed(tuple(range(3, 11)), None, None)])  # 8 of 10 blocks evicted
    decision = d.decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT), DECODES, PREFILLS, 2.0)
    assert decision.route is Route.PUSH and decision.decode == "d1" and decision.predicted_cached_tokens == 32


def test_the_prefill_pick_follows_the_session_held_on_prefill() -> None:
    engines = Engines()
    engines.store("p2", 10, "s")
    engines.up.add("p1")
    decision = decider(engines).decide(chat(QUESTION, SHORT), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.prefill) == (Route.PUSH, "p2")


def test_a_token_id_prompt_is_matched_exactly() -> None:
    engines = Engines()
    prompt = list(range(100, 100 + 10 * BLOCK + 5))  # 10 whole blocks and 5 tokens
    engines.store("d2", 10, None, prompt)
    engines.up.add("d1")
    body = {"model": "m", "max_tokens": 8, "prompt": prompt}
    t = Turn(RequestInfo(Endpoint.COMPLETIONS, False, 100), body, {}, Mode.PUSH)
    decision = decider(engines).decide(t, DECODES, PREFILLS, 1.0)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.BYPASS, "d2", 10 * BLOCK)
    assert decision.state.predicted_uncached == 5
    other = Turn(RequestInfo(Endpoint.COMPLETIONS, False, 100), {**body, "prompt": [7, *prompt]}, {}, Mode.PUSH)
    assert decider(engines).decide(other, DECODES, PREFILLS, 1.0).route is Route.PUSH


def test_prompt_token_ids() -> None:
    assert prompt_token_ids({"prompt": [1, 2]}) == [1, 2]
    assert prompt_token_ids({"prompt": [[1, 2]]}) == [1, 2]
    for prompt in ("text", [], [[1], [2]], [1, True], [1.0], None):
        assert prompt_token_ids({"prompt": prompt}) is None


def test_another_replicas_turns_are_placed_at_a_message_boundary_so_the_suffix_is_the_new_message() -> None:
    """The ratio overestimates this conversation's tokens by about a fifth: placed by the ratio, the engine's 768
    held tokens would end some 500 characters before the new message and the suffix be predicted ~130 tokens;
    placed at the boundary before the new message, it is that message plus half a block."""
    engines = Engines()
    history = [{"role": "user", "content": "word " * 360}, {"role": "assistant", "content": "more " * 360}]
    engines.store("d2", 48, "s")  # 768 tokens of the session: what the engine really computed for the history
    engines.up.add("d1")
    d = decider(engines)
    decision = d.decide(chat(*history, SHORT), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.BYPASS, "d2", 768)
    assert decision.state.predicted_uncached < 2 * BLOCK  # the new message's ~10 tokens and half a block


def test_a_replica_that_served_an_earlier_turn_follows_the_engine_past_what_it_saw() -> None:
    """Turns alternate replicas: this one served turn 1, another served turn 2, and turn 3 comes back here. Its
    own index ends at turn 1's answer; the engine holds turn 2 as well, so the suffix is turn 3's message alone."""
    engines = Engines()
    d = decider(engines)
    first = chat(QUESTION)
    served(d, first, d.decide(first, DECODES, PREFILLS, 1.0), "d1", 80)
    turn2 = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "more " * 800}]
    engines.store("d1", 1 + (80 + 97 + 50 + 1000) // BLOCK, "s")  # turns 1 and 2, as the engine computed them
    engines.up.add("d2")
    third = chat(QUESTION, {"role": "assistant", "content": ANSWER}, *turn2, SHORT)
    decision = d.decide(third, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d1")
    assert decision.state.predicted_uncached < 2 * BLOCK


def test_the_part_block_past_the_held_blocks_is_counted_from_this_replicas_own_match() -> None:
    """CPU engines use 128-token blocks: guessing half a block past the held ones would be off by up to 64 tokens
    of a suffix of ~20. The replica counts the boundary's tokens from its own exact match (turn 1's prompt and
    answer) plus the estimate of turn 2, and adds what of that fills no whole block."""
    engines = Engines()
    d = SessionAffinity(AffinityOptions(block_tokens=128), engines.view)
    first = chat(QUESTION)
    served(d, first, d.decide(first, DECODES, PREFILLS, 1.0), "d1", 80)  # 80 prompt + 97 answer tokens
    turn2 = [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "more " * 140}]
    third = chat(QUESTION, {"role": "assistant", "content": ANSWER}, *turn2, SHORT)
    links = conversation_key(Endpoint.CHAT, third.body, third.headers, 256).chain.links
    boundary = 80 + 97 + d.ratio.tokens(links[-2].chars - links[2].chars)  # links[2]: turn 1's answer
    engines.store("d1", (boundary // 128) * 8, "s")  # whole 128-token blocks, stored as 16-token ones
    engines.up.add("d2")
    decision = d.decide(third, DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode) == (Route.BYPASS, "d1")
    suffix = d.ratio.tokens(links[-1].chars - links[-2].chars)
    assert decision.state.predicted_uncached == suffix + boundary % 128


# --- answers another replica relayed: checked against the engine's stored token ids ------------------------------

PROMPT_1 = [5000 + i for i in range(75)]  # turn 1's prompt as the engine tokenized it: 4 whole blocks and 11
GENERATED = [7000 + i for i in range(97)]  # the answer's generated ids (the last one sampled, never computed)
ANSWER_ALIKE = [*GENERATED[:20], *[9000 + i for i in range(70)]]  # its text re-tokenizes otherwise from token 20


def chained(engines: Engines, worker: str, session: str, runs: list[list[int]]) -> None:
    """The session's blocks as vLLM stores them: each run (a prefill, a block decode filled) chained to the last."""
    index, parent, done = engines.index.stream(worker, 0), None, 0
    engines.up.add(worker)
    for tokens in runs:
        blocks = len(tokens) // BLOCK
        hashes = tuple(range(engines._next, engines._next + blocks))
        engines._next += blocks
        index.apply([Stored(hashes, parent, tuple(tokens[: blocks * BLOCK]), BLOCK, None, None, False, session)])
        parent, done = hashes[-1], done + blocks


def turn_1_elsewhere(engines: Engines) -> None:
    """Turn 1 went through the other replica to d2: its prompt's 4 whole blocks at prefill, then the blocks its
    answer filled (tokens 64-159: the prompt's last 11 and the first 85 generated)."""
    computed = [*PROMPT_1, *GENERATED[:-1]]
    chained(engines, "d2", "s", [computed[:64], *[computed[i : i + BLOCK] for i in range(64, 160, BLOCK)]])
    engines.up.add("d1")


class Spy:
    def __init__(self, ids: list[int]) -> None:
        self.ids, self.calls = ids, 0

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return self.ids


def test_an_answer_another_replica_relayed_is_credited_as_far_as_its_text_retokenizes_to_the_stored_ids() -> None:
    """Run 20261205T075552Z: the replica a turn alternated to credited the whole previous answer the engine had
    stored (its generated ids) and under-predicted the uncached work by 137-241 tokens. The answer's text, encoded
    in the router, agrees with the stored ids for 20 tokens: decode holds turn 1 up to token 95, 5 whole blocks."""
    engines = Engines()
    turn_1_elsewhere(engines)
    spy = Spy(ANSWER_ALIKE)
    d = SessionAffinity(AffinityOptions(block_tokens=BLOCK), engines.view, spy)
    second = chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT)
    decision = d.decide(second, DECODES, PREFILLS, 2.0)
    assert (decision.decode, decision.predicted_cached_tokens, spy.calls) == ("d2", 80, 1)
    assert decision.state.predicted_uncached == decision.state.held.tokens - 80 + d._uncached(
        conversation_key(Endpoint.CHAT, second.body, second.headers, 256).chain, decision.state.held
    )
    assert decision.state.held.tokens == 75 + len(ANSWER_ALIKE)  # the answer's end, from the engine's own count
    assert d.stats().event_answer_checks == 1
    without = decider(engines).decide(second, DECODES, PREFILLS, 2.0)  # no tokenizer: the whole answer credited
    assert (without.route, without.predicted_cached_tokens) == (Route.BYPASS, 160)


def test_an_answer_that_retokenizes_as_generated_is_credited_whole() -> None:
    engines = Engines()
    turn_1_elsewhere(engines)
    d = SessionAffinity(AffinityOptions(block_tokens=BLOCK), engines.view, Spy(GENERATED))
    decision = d.decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT), DECODES, PREFILLS, 2.0)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.BYPASS, "d2", 160)


def test_the_tokenizer_runs_only_for_a_bypass_candidate_whose_answer_this_replica_did_not_check() -> None:
    engines = Engines()
    turn_1_elsewhere(engines)
    spy = Spy(ANSWER_ALIKE)
    d = SessionAffinity(AffinityOptions(block_tokens=BLOCK), engines.view, spy)
    long_message = {"role": "user", "content": "A long new question. " * 200}
    decision = d.decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, long_message), DECODES, [], 2.0)
    assert decision.route is Route.PUSH and spy.calls == 0  # not a bypass candidate: nothing encoded
    own = SessionAffinity(AffinityOptions(block_tokens=BLOCK), engines.view, spy)
    first = chat(QUESTION)
    served(own, first, own.decide(first, DECODES, PREFILLS, 1.0), "d2", 75)  # this replica relayed the answer
    assert own.decide(chat(QUESTION, {"role": "assistant", "content": ANSWER}, SHORT), DECODES, [], 2.0).decode == "d2"
    assert spy.calls == 0 and own.stats().event_answer_checks == 0


def test_a_shared_system_prompt_counts_for_every_session_that_extends_it() -> None:
    """Two sessions open with the same long system prompt: the engine stores its blocks once (the first session's)
    and the second session's prompt chains from them. Its held prefix is the whole chain, not only its own
    blocks, so its next turn through another replica is bypassed with the system prompt counted."""
    engines = Engines()
    system = [3000 + i for i in range(10 * BLOCK)]
    chained(engines, "d2", "first", [system, [1 + i for i in range(2 * BLOCK)]])
    index = engines.index.stream("d2", 0)
    tail_parent = 10  # the system prompt's last block (hashes 1-10)
    index.apply([Stored((100, 101), tail_parent, tuple(range(2 * BLOCK)), BLOCK, None, None, False, "s")])
    engines.up.add("d1")
    assert engines.view.session_tokens("s") == {"d2": 12 * BLOCK}
    assert engines.view.session_holders("s") == {"d2": 2}  # the blocks it stored itself, once each
    history = [{"role": "system", "content": "rules " * 150}, {"role": "user", "content": "word " * 25}]
    decision = decider(engines).decide(chat(*history, {"role": "assistant", "content": "ok"}, SHORT), DECODES, [], 2)
    assert (decision.route, decision.decode, decision.predicted_cached_tokens) == (Route.BYPASS, "d2", 12 * BLOCK)


def test_an_answer_is_aligned_where_most_of_it_agrees_nearest_the_estimate() -> None:
    ids = [1, 2, 9, 5, 6, 7, 3, 5, 6, 7, 8, 4, 4, 4, 4, 4]  # the answer [5, 6, 7, 8] starts at 7 (chain 107)
    tail = SessionTail(100, ids, 16)
    assert align(tail, [5, 6, 7, 8], 104, 8) == (107, 4)  # not at 103, where only 3 agree
    assert align(tail, [5, 6, 7, 0], 104, 8) == (103, 3)  # a tie: the nearer
    assert align(tail, [9, 0], 104, 8) == (104, 0)  # one id agreeing places nothing
    assert align(tail, [5, 6, 7, 8], 100, 2) == (100, 0)  # out of reach
