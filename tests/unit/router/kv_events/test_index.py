"""The block index: chains of stored blocks matched by a prompt's token ids, removal, media, groups, bounds."""

from __future__ import annotations

import pytest

from router.kv_events.frames import Cleared, Removed, Stored
from router.kv_events.index import TIP_TOKENS, HeldPrefix, KvIndex, PromptKeys, StreamIndex, content_keys

BS = 4
PROMPT = list(range(100, 118))  # 4 whole blocks and 2 tokens


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    medium: str | None = "GPU",
    group: int | None = 0,
    keyed: bool = False,
    block_size: int = BS,
    session: str | None = None,
) -> Stored:
    return Stored(tuple(hashes), parent, tuple(tokens), block_size, medium, group, keyed, session)


def held(index: StreamIndex, tokens: list[int]) -> int:
    return index.longest(PromptKeys(tokens))


def test_a_stored_chain_matches_its_tokens_block_by_block() -> None:
    index = StreamIndex(100)
    index.stored(stored([1, 2], None, PROMPT[:8]))
    index.stored(stored([3], 2, PROMPT[8:12]))
    assert held(index, PROMPT) == 3
    assert held(index, PROMPT[:11]) == 2  # the third block is not whole in this prompt
    assert held(index, PROMPT[:4] + [0] * 8) == 1
    assert held(index, [0, *PROMPT[1:]]) == 0
    assert (len(index), index.matchable(), index.block_size) == (3, 3, BS)


def test_a_block_whose_parent_is_unknown_is_held_but_never_matches() -> None:
    index = StreamIndex(100)
    index.stored(stored([2], 1, PROMPT[4:8]))
    index.stored(stored([3], 2, PROMPT[8:12]))
    assert held(index, PROMPT) == 0
    assert (len(index), index.matchable(), index.counters.orphans) == (2, 0, 2)
    index.removed(Removed((2, 3), "GPU", 0))
    assert len(index) == 0 and index.counters.removed == 2


def test_keyed_blocks_and_their_children_never_match() -> None:
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4], keyed=True))
    index.stored(stored([2], 1, PROMPT[4:8]))
    assert held(index, PROMPT) == 0
    assert index.counters.keyed == 1 and index.counters.orphans == 1


def test_removing_a_middle_block_cuts_the_match_there() -> None:
    index = StreamIndex(100)
    index.stored(stored([1, 2, 3], None, PROMPT[:12]))
    index.removed(Removed((2,), "GPU", 0))
    assert held(index, PROMPT) == 1
    index.removed(Removed((99,), "GPU", 0))
    assert index.counters.unknown_removed == 1


def test_a_block_goes_when_its_last_medium_removes_it() -> None:
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4], medium=None))  # unspecified: the GPU pool
    index.stored(stored([1], None, PROMPT[:4], medium="CPU"))
    index.removed(Removed((1,), "GPU", 0))
    assert held(index, PROMPT) == 1
    index.removed(Removed((1,), "CPU", 0))
    assert held(index, PROMPT) == 0 and len(index) == 0
    index.stored(stored([1], None, PROMPT[:4], medium="NVME"))
    index.removed(Removed((1,), "GPU", 0))
    assert held(index, PROMPT) == 1


def test_other_groups_and_other_block_sizes_are_not_indexed() -> None:
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4], group=1))
    assert len(index) == 0 and index.counters.other_group == 1
    index.stored(stored([1], None, PROMPT[:4], group=None))  # unspecified: group 0
    index.stored(stored([7], 1, PROMPT[4:6], block_size=2))
    assert (len(index), index.counters.other_size) == (1, 1)
    index.removed(Removed((1,), "GPU", 1))
    assert len(index) == 1


def test_the_bound_drops_the_block_stored_longest_ago() -> None:
    index = StreamIndex(3)
    index.stored(stored([1, 2, 3], None, PROMPT[:12]))
    index.stored(stored([1], None, PROMPT[:4]))  # stored again (reused): now the newest
    index.stored(stored([4], 3, PROMPT[12:16]))
    assert len(index) == 3 and index.counters.capacity == 1
    assert held(index, PROMPT) == 1  # block 2 went: the chain stops after block 1
    index.stored(stored([5, 6, 7, 8], None, [0] * 16))
    assert len(index) == 3 and index.counters.capacity == 5


def test_cleared_empties_the_stream() -> None:
    index = StreamIndex(100)
    index.apply([stored([1, 2], None, PROMPT[:8]), Cleared(), stored([3], None, PROMPT[:4])])
    assert held(index, PROMPT) == 1 and len(index) == 1 and index.counters.cleared == 1
    assert index.counters.dropped == 2


def test_a_hash_stored_again_under_other_content_is_rekeyed() -> None:
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4]))
    index.stored(stored([1], None, PROMPT[4:8]))
    assert held(index, PROMPT) == 0
    assert held(index, PROMPT[4:8]) == 1 and index.matchable() == 1


def test_the_prompts_keys_are_the_chain_of_its_blocks() -> None:
    keys = content_keys(PROMPT, BS)
    prompt = PromptKeys(PROMPT)
    assert [prompt.key(BS, i) for i in range(5)] == [*keys, None]
    assert len(keys) == 4 and len(set(keys)) == 4
    assert content_keys(PROMPT[4:8], BS, parent=keys[0]) == [keys[1]]


def test_a_worker_is_matched_on_its_best_rank() -> None:
    index = KvIndex(100)
    index.stream("w", 0).stored(stored([1], None, PROMPT[:4]))
    index.stream("w", 1).stored(stored([1, 2], None, PROMPT[:8]))
    index.stream("v", 0).stored(stored([9], None, [0] * 4))
    assert index.longest_held_prefix("w", PROMPT) == HeldPrefix("w", 8, 2, 1)
    assert index.longest_held_prefix("v", PROMPT) == HeldPrefix("v", 0, 0, None)
    assert index.longest_held_prefix("nobody", PROMPT) == HeldPrefix("nobody", 0, 0, None)
    assert (index.workers(), index.blocks(), index.blocks("w")) == (["v", "w"], 4, 3)
    assert index.counters.stored == 4  # one set of counters for every stream
    index.drop("w", 1)
    assert index.longest_held_prefix("w", PROMPT).blocks == 1
    index.drop("w")
    assert index.workers() == ["v"] and index.counters.dropped == 3


def test_bounds_are_positive() -> None:
    with pytest.raises(ValueError):
        StreamIndex(0)
    with pytest.raises(ValueError):
        KvIndex(0)


def test_a_lookup_keys_the_prompt_only_as_far_as_it_matches() -> None:
    index = StreamIndex(1000)
    index.stored(stored([1], None, PROMPT[:4]))
    long_prompt = PROMPT[:4] + list(range(400))
    prompt = PromptKeys(long_prompt)
    assert index.longest(prompt) == 1
    assert len(prompt.keys(BS, 0)) == 8  # of 101 blocks
    chain = list(range(1, 102))
    index.stored(stored(chain, None, long_prompt[:404]))
    assert index.longest(PromptKeys(long_prompt)) == 101


def test_blocks_are_counted_for_the_session_that_stored_them_last() -> None:
    index = KvIndex(4)
    w0 = index.stream("w", 0)
    w0.stored(stored([1, 2, 3], None, PROMPT[:12], session="s1"))
    w0.stored(stored([3], 2, PROMPT[8:12], session="s2"))  # a reused block, reported for s2's request
    w0.stored(stored([4], 3, PROMPT[12:16]))  # no session
    assert (w0.session_blocks("s1"), w0.session_blocks("s2"), w0.session_blocks("s3")) == (2, 1, 0)
    w0.removed(Removed((2,), "GPU", 0))
    assert w0.session_blocks("s1") == 1
    w0.stored(stored([5, 6], None, [0] * 8, session="s3"))  # the bound (4) pushes out block 1
    assert (w0.session_blocks("s1"), w0.session_blocks("s2"), w0.session_blocks("s3")) == (0, 1, 2)
    index.stream("w", 1).stored(stored([7], None, [1] * 4, session="s3"))
    index.stream("v", 0).stored(stored([7], None, [1] * 4, session="s3"))
    assert index.session_holders("s3") == {"w": 2, "v": 1}
    assert index.session_holders("s1") == {}
    w0.cleared()
    assert index.session_holders("s3") == {"w": 1, "v": 1}


def test_a_sessions_tip_follows_its_chain_and_branches_where_a_next_prompt_parts_from_it() -> None:
    index = StreamIndex(100)
    index.stored(stored([1, 2], None, PROMPT[:8], session="s"))  # the prompt's blocks
    index.stored(stored([3], 2, [7, 7, 7, 7], session="s"))  # a block its answer filled
    tail = index.session_tail("s")
    assert tail is not None and (tail.start, list(tail.tokens), tail.end) == (0, [*PROMPT[:8], 7, 7, 7, 7], 12)
    index.stored(stored([4, 5], 2, [8] * 8, session="s"))  # the next prompt parts from the answer after block 2
    tail = index.session_tail("s")
    assert tail is not None and (tail.start, list(tail.tokens), tail.end) == (8, [8] * 8, 16)
    assert KvIndex(1).session_tokens("s") == {}
    index.removed(Removed((5,), "GPU", 0))  # the tip's last block evicted: held up to it
    assert (index.session_tail("s") or tail).end == 12
    index.removed(Removed((1, 2, 3, 4), "GPU", 0))
    assert index.session_tail("s") is None and index.session_blocks("s") == 0


def test_a_tip_is_bounded_and_unknown_without_its_chain() -> None:
    index = StreamIndex(10_000)
    parent = None
    for i in range(1, 1 + 3000 // BS):  # one block per event, as decode fills them
        index.stored(stored([i], parent, [i] * BS, session="s"))
        parent = i
    tail = index.session_tail("s")
    assert tail is not None and tail.end == 3000 // BS * BS and len(tail.tokens) <= TIP_TOKENS
    index.stored(stored([90_001], 80_000, [1] * BS, session="orphan"))  # its parent was never seen
    assert index.session_tail("orphan") is None and index.session_blocks("orphan") == 1
    index.cleared()
    assert index.session_tail("s") is None


def test_a_block_stored_as_two_copies_goes_with_the_second_removal() -> None:
    """vLLM 0.32-0.34: a block-aligned prompt served again recomputes its last block and caches a second physical
    copy under the same hash (a BlockStored); each copy's eviction sends its own BlockRemoved."""
    index = StreamIndex(100)
    index.stored(stored([1, 2], None, PROMPT[:8]))
    index.stored(stored([2], 1, PROMPT[4:8]))  # the recomputed last block: a second copy
    index.removed(Removed((2,), "GPU", 0))
    assert held(index, PROMPT) == 2 and index.counters.copy_removed == 1
    index.removed(Removed((2,), "GPU", 0))
    assert held(index, PROMPT) == 1 and index.counters.removed == 1
    assert (index.counters.copies, len(index)) == (1, 1)


def test_a_block_stored_once_goes_with_its_one_removal() -> None:
    index = StreamIndex(100)
    index.stored(stored([1, 2], None, PROMPT[:8]))
    index.removed(Removed((1, 2), "GPU", 0))
    assert len(index) == 0 and index.counters.removed == 2 and index.counters.copy_removed == 0


def test_copies_are_counted_per_medium() -> None:
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4]))
    index.stored(stored([1], None, PROMPT[:4], medium="CPU"))
    index.stored(stored([2], 1, PROMPT[4:8]))
    index.stored(stored([2], 1, PROMPT[4:8]))  # two GPU copies of block 2
    index.removed(Removed((1, 2), "GPU", 0))
    assert held(index, PROMPT) == 2  # block 1 on CPU, block 2's second GPU copy
    index.removed(Removed((1, 2), "CPU", 0))  # no CPU copy of block 2: nothing to take
    assert held(index, PROMPT) == 0 and len(index) == 1


def test_a_reuse_report_adds_no_copy() -> None:
    """kv_cache_report_mode "full": a prefix-cache hit is reported as a BlockStored of the blocks hit, from the
    first, with no parent; no new physical copy, so no removal will follow for it."""
    index = StreamIndex(100)
    index.stored(stored([1, 2], None, PROMPT[:8]))
    index.stored(stored([1, 2], None, PROMPT[:8], session="s"))  # reported twice
    index.stored(stored([1, 2], None, PROMPT[:8], session="t"))
    assert index.counters.reports == 4 and index.counters.copies == 0
    index.removed(Removed((1, 2), "GPU", 0))
    assert len(index) == 0


def test_the_engine_s_remaining_copy_count_is_believed() -> None:
    """vllm#48933's shape: each removal says how many copies of the hash remain."""
    index = StreamIndex(100)
    index.stored(stored([1], None, PROMPT[:4]))
    index.stored(stored([2], 1, PROMPT[4:8]))
    index.removed(Removed((2,), "GPU", 0, (1,)))  # one counted here, but the engine still holds one
    assert held(index, PROMPT) == 2
    index.stored(stored([2], 1, PROMPT[4:8]))
    index.stored(stored([2], 1, PROMPT[4:8]))  # three counted
    index.removed(Removed((2,), "GPU", 0, (0,)))
    assert held(index, PROMPT) == 1 and index.counters.removed == 1


def lookahead_stored(hashes: list[int], parent: int | None, start: int, ahead: int) -> Stored:
    """Blocks of PROMPT from block `start`, each hashed with the `ahead` prompt tokens after it."""
    tokens = PROMPT[start * BS : (start + len(hashes)) * BS]
    after = tuple(tuple(PROMPT[(start + i + 1) * BS : (start + i + 1) * BS + ahead]) for i in range(len(hashes)))
    return Stored(tuple(hashes), parent, tuple(tokens), BS, "GPU", 0, False, None, after)


def test_a_block_hashed_with_lookahead_matches_only_a_prompt_that_continues_with_it() -> None:
    """vLLM 0.33+ lookahead hashing: the engine hits a block only for a prompt whose tokens after it are the
    ones its hash covered."""
    index = StreamIndex(100)
    index.stored(lookahead_stored([1, 2, 3], None, 0, 2))
    assert held(index, PROMPT) == 3  # 18 tokens: the third block's two tokens after it are there
    assert held(index, PROMPT[:13]) == 2  # only one token after the third block: the engine cannot hash it
    assert held(index, PROMPT[:12]) == 2
    assert held(index, [*PROMPT[:8], *PROMPT[8:12], 0, 0]) == 2  # other tokens after the third block
    assert held(index, [*PROMPT[:8], *PROMPT[8:12], PROMPT[12], 0]) == 2
    assert index.counters.lookahead == 3 and index.counters.keyed == 0
    index.stored(stored([4], 3, PROMPT[12:16]))  # its child chains as usual
    assert held(index, PROMPT) == 4
    index.removed(Removed((1, 2, 3, 4), "GPU", 0))
    index.stored(stored([1, 2, 3], None, PROMPT[:12]))  # the same hashes again, token-only
    assert held(index, PROMPT[:12]) == 3
