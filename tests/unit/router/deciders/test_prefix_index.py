"""The per-worker prefix index, the session table and the learned token ratio: bounds, ageing, forgetting."""

from __future__ import annotations

from typing import Any

import pytest

from router.deciders.conversation import Chain, chain_of
from router.deciders.prefix_index import PrefixIndex, SessionTable, TokenRatio, prorated, reusable_answer_tokens
from router.domain import Endpoint


def chat(*contents: str) -> Chain:
    messages: list[dict[str, Any]] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)
    ]
    return chain_of(Endpoint.CHAT, {"model": "m", "messages": messages})


def record(index: PrefixIndex, worker: str, chain: Chain, now: float) -> None:
    index.record(worker, chain.links, [10 * (i + 1) for i in range(len(chain.links))], now)


def test_longest_finds_the_deepest_held_link_of_a_later_turn() -> None:
    index = PrefixIndex(100, ttl_s=60)
    record(index, "d1", chat("q1", "a1"), now=0)
    match = index.longest("d1", chat("q1", "a1", "q2"), now=1)
    assert (match.worker, match.links, match.tokens) == ("d1", 3, 30)
    assert match.chars == chat("q1", "a1").chars


def test_nothing_held_gives_an_empty_match() -> None:
    index = PrefixIndex(100, ttl_s=60)
    record(index, "d1", chat("q1"), now=0)
    assert index.longest("d2", chat("q1"), now=0).links == 0
    head_only = index.longest("d1", chat("other"), now=0)  # only the head link (model, no tools) is shared
    assert (head_only.links, head_only.chars) == (1, 0)


def test_a_match_says_how_much_of_its_prefix_the_cache_can_reuse() -> None:
    index = PrefixIndex(100, ttl_s=60)
    record(index, "d1", chat("q1"), now=0)
    assert index.longest("d1", chat("q1", "a1"), now=0).reusable == 20  # recorded without a bound: all of it
    links = chat("q1", "a1").links
    index.record("d2", links, [10, 20, 35], now=0, reusable=24)  # the answer's tokens do not all re-tokenize
    match = index.longest("d2", chat("q1", "a1", "q2"), now=0)
    assert (match.links, match.tokens, match.reusable) == (3, 35, 24)
    assert index.longest("d2", chat("q1"), now=0).reusable == 20  # a bound above a link's count leaves it whole


@pytest.mark.parametrize(
    ("answer", "tokens", "reusable"),
    [
        ("plain text that round-trips", 6, 5),  # all but the last sampled token, which is never fed back
        ("abcde\ufffdfghij", 10, 4),  # up to the replacement character: 10 tokens x 5 // 11 chars
        ("\ufffdat once", 8, 0),
        ("**", 40, 0),  # more tokens than bytes: tokens the text does not show
        ("", 5, 0),
        ("ab", 3, 2),  # as many tokens as bytes after the final one is still possible
        ("anything", 0, 0),
    ],
)
def test_reusable_answer_tokens_stop_where_the_text_cannot_re_tokenize_as_generated(
    answer: str, tokens: int, reusable: int
) -> None:
    assert reusable_answer_tokens(answer, tokens) == reusable


def test_a_diverged_history_matches_only_its_common_prefix() -> None:
    index = PrefixIndex(100, ttl_s=60)
    record(index, "d1", chat("q1", "a1", "q2", "a2"), now=0)
    assert index.longest("d1", chat("q1", "A1", "q2", "a2", "q3"), now=0).links == 2


def test_links_expire_after_the_ttl() -> None:
    index = PrefixIndex(100, ttl_s=10)
    record(index, "d1", chat("q1"), now=0)
    assert index.longest("d1", chat("q1"), now=9.9).links == 2
    assert index.longest("d1", chat("q1"), now=10).links == 0
    assert index.evictions.expired == 2 and len(index) == 0


def test_recording_again_refreshes_the_age() -> None:
    index = PrefixIndex(100, ttl_s=10)
    record(index, "d1", chat("q1"), now=0)
    record(index, "d1", chat("q1", "a1"), now=8)
    assert index.longest("d1", chat("q1", "a1"), now=15).links == 3


def test_expire_ages_every_worker() -> None:
    index = PrefixIndex(100, ttl_s=10)
    record(index, "d1", chat("q1"), now=0)
    record(index, "d2", chat("q2"), now=5)
    index.expire(now=12)
    assert index.size("d1") == 0 and index.size("d2") == 2


def test_the_bound_evicts_least_recently_recorded_links_first() -> None:
    index = PrefixIndex(4, ttl_s=60)
    record(index, "d1", chat("old"), now=0)  # 2 links: head + message
    record(index, "d1", chat("new", "x", "y"), now=1)  # head (refreshed) + 3 links: 'old' goes
    assert index.size("d1") == 4
    assert index.evictions.capacity == 1
    assert index.longest("d1", chat("old"), now=2).links == 1  # the head survives (refreshed)
    assert index.longest("d1", chat("new", "x", "y"), now=2).links == 4


def test_bounds_are_per_worker() -> None:
    index = PrefixIndex(3, ttl_s=60)
    record(index, "d1", chat("a", "b"), now=0)
    record(index, "d2", chat("c", "d"), now=0)
    assert len(index) == 6 and index.workers() == ["d1", "d2"]


def test_forget_drops_a_worker_whole() -> None:
    index = PrefixIndex(100, ttl_s=60)
    record(index, "d1", chat("q1"), now=0)
    record(index, "d2", chat("q1"), now=0)
    index.forget("d1")
    index.forget("never-seen")
    assert index.longest("d1", chat("q1"), now=0).links == 0
    assert index.longest("d2", chat("q1"), now=0).links == 2
    assert index.evictions.forgotten == 2


def test_record_needs_one_count_per_link_and_the_index_positive_bounds() -> None:
    index = PrefixIndex(100, ttl_s=60)
    with pytest.raises(ValueError, match="one token count"):
        index.record("d1", chat("q").links, [1], now=0)
    for bound, ttl in ((0, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            PrefixIndex(bound, ttl)


def test_session_table_remembers_the_last_worker() -> None:
    table = SessionTable(10, ttl_s=30)
    table.set("s", "d1", now=0)
    table.set("s", "d2", now=1)
    assert table.get("s", now=2) == "d2" and len(table) == 1
    assert table.get("unknown", now=2) is None


def test_session_table_ages_bounds_and_forgets() -> None:
    table = SessionTable(2, ttl_s=30)
    table.set("a", "d1", now=0)
    table.set("b", "d2", now=1)
    table.set("c", "d1", now=2)  # over the bound: 'a' goes
    assert table.get("a", now=3) is None and table.evictions.capacity == 1
    assert table.get("b", now=31) is None and table.evictions.expired == 1
    table.set("d", "d2", now=40)  # 'c' (from t=2) has aged out too
    assert len(table) == 1 and table.evictions.expired == 2
    table.forget("d2")
    assert len(table) == 0 and table.evictions.forgotten == 1
    with pytest.raises(ValueError):
        SessionTable(0, 1.0)


def test_token_ratio_starts_from_the_guess_then_follows_reports() -> None:
    ratio = TokenRatio(initial=0.25, weight=0.5)
    assert ratio.tokens(400) == 100
    ratio.learn(tokens=200, chars=400)  # the first report replaces the guess
    assert ratio.value == pytest.approx(0.5)
    ratio.learn(tokens=100, chars=400)
    assert ratio.value == pytest.approx(0.375)
    ratio.learn(tokens=0, chars=400)  # nothing to learn from
    ratio.learn(tokens=10, chars=0)
    assert ratio.samples == 2
    with pytest.raises(ValueError):
        TokenRatio(initial=0)


def test_prorated_spreads_the_reported_tokens_and_the_last_link_gets_them_all() -> None:
    chain = chat("a" * 100, "b" * 300)
    counts = prorated(chain.links, chain.chars, 1000)
    assert counts[0] == 0 and counts[-1] == 1000
    assert counts == sorted(counts)
    assert prorated(chain.links, 0, 1000) == [0, 0, 0]


def test_refine_sets_what_links_recorded_then_can_reuse() -> None:
    index = PrefixIndex(100, ttl_s=60)
    chain = chat("q1", "a1")
    index.record("d1", chain.links, [10, 20, 30], now=1.0)
    index.refine("d1", chain.links[2:], recorded_at=1.0, reusable=24, tokens=[33])
    match = index.longest("d1", chat("q1", "a1", "q2"), now=2.0)
    assert (match.tokens, match.reusable) == (33, 24)
    index.refine("d1", chain.links[2:], recorded_at=1.0, reusable=99, tokens=[30])  # never above what it holds
    assert index.longest("d1", chain, now=2.0).reusable == 30


def test_refine_leaves_links_recorded_again_since_and_unknown_workers() -> None:
    index = PrefixIndex(100, ttl_s=60)
    chain = chat("q1", "a1")
    index.record("d1", chain.links, [10, 20, 30], now=1.0)
    index.record("d1", chain.links, [10, 20, 30], now=3.0)  # a later turn sent the answer as its prompt
    index.refine("d1", chain.links, recorded_at=1.0, reusable=5, tokens=[5, 5, 5])
    index.refine("d2", chain.links, recorded_at=1.0, reusable=5, tokens=[5, 5, 5])
    assert index.longest("d1", chain, now=4.0).reusable == 30 and index.workers() == ["d1"]
