"""Rank mapping under TP (equal and unequal, replicated heads) and PP prefill: ``connector.parallel.topology``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.parallel.topology import Slice, TopologyError, even_layer_windows, heads_of, plan
from connector.wire.metadata import RankId

TPS = st.sampled_from([1, 2, 4, 8])


@given(
    p_tp=TPS,
    d_tp=TPS,
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    head_bytes=st.sampled_from([1, 8, 96]),
    layers=st.integers(2, 5),
    p_pp=st.integers(1, 2),
)
def test_every_byte_of_every_decode_block_is_written_exactly_once_by_a_rank_that_holds_it(
    p_tp: int, d_tp: int, heads: int, head_bytes: int, layers: int, p_pp: int
) -> None:
    topo = plan(p_tp=p_tp, d_tp=d_tp, num_kv_heads=heads, head_bytes=head_bytes, num_layers=layers, p_pp=p_pp)
    p_block, d_block = topo.block_bytes(p_tp), topo.block_bytes(d_tp)
    for d in range(d_tp):
        covered = [[0] * d_block for _ in range(layers)]
        d_heads = heads_of(d, d_tp, heads)
        for leg in topo.legs_into(d):
            p_heads = heads_of(leg.src.tp, p_tp, heads)
            for s in leg.slices:
                assert s.src >= 0 and s.src + s.length <= p_block and s.dst >= 0 and s.dst + s.length <= d_block
                for off in range(s.length):  # the byte's head is the same on both sides
                    assert p_heads[(s.src + off) // head_bytes] == d_heads[(s.dst + off) // head_bytes]
                    assert (s.src + off) % head_bytes == (s.dst + off) % head_bytes
                    for layer in range(*leg.layers):
                        covered[layer][s.dst + off] += 1
        assert all(c == 1 for row in covered for c in row), f"D rank {d}: a byte written 0 or 2+ times"
        assert set(topo.sources(d)) == {leg.src for leg in topo.legs_into(d)}
    for p in {leg.src for leg in topo.legs}:
        assert topo.targets(p) == tuple(sorted({leg.dst for leg in topo.legs if leg.src == p}))


@given(tp=TPS, heads=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 4))
def test_equal_tp_is_the_identity_with_whole_blocks(tp: int, heads: int, layers: int) -> None:
    topo = plan(p_tp=tp, d_tp=tp, num_kv_heads=heads, head_bytes=64, num_layers=layers)
    assert [(leg.src, leg.dst) for leg in topo.legs] == [(RankId(0, r), r) for r in range(tp)]
    assert all(leg.whole_blocks and leg.layers == (0, layers) for leg in topo.legs)


def test_two_prefill_ranks_into_one_decode_rank_each_write_their_half() -> None:
    topo = plan(p_tp=2, d_tp=1, num_kv_heads=4, head_bytes=10, num_layers=2)
    assert topo.sources(0) == (RankId(0, 0), RankId(0, 1))
    assert [leg.slices for leg in topo.legs] == [(Slice(0, 0, 20),), (Slice(0, 20, 20),)]
    assert not any(leg.whole_blocks for leg in topo.legs)


def test_one_prefill_rank_into_two_decode_ranks_sends_each_its_half() -> None:
    topo = plan(p_tp=1, d_tp=2, num_kv_heads=4, head_bytes=10, num_layers=2)
    assert topo.targets(RankId(0, 0)) == (0, 1)
    assert [(leg.dst, leg.slices) for leg in topo.legs] == [(0, (Slice(0, 0, 20),)), (1, (Slice(20, 0, 20),))]


def test_replicated_heads_spread_over_their_holders_and_are_never_copied_twice() -> None:
    # 2 KV heads, P_tp 4: P ranks 0,1 hold head 0, ranks 2,3 head 1; D_tp 4 likewise (replicated on D).
    topo = plan(p_tp=4, d_tp=4, num_kv_heads=2, head_bytes=8, num_layers=1)
    assert [(leg.src.tp, leg.dst) for leg in topo.legs] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    one_d = plan(p_tp=4, d_tp=1, num_kv_heads=2, head_bytes=8, num_layers=1)
    assert [(leg.src.tp, leg.slices) for leg in one_d.legs] == [(0, (Slice(0, 0, 8),)), (2, (Slice(0, 8, 8),))]
    assert one_d.sources(0) == (RankId(0, 0), RankId(0, 2)), "ranks 1 and 3 hold copies: they send nothing"


def test_pp_prefill_stages_write_their_layer_windows() -> None:
    topo = plan(p_tp=1, d_tp=1, num_kv_heads=2, head_bytes=8, num_layers=5, p_pp=2)
    assert [(leg.src, leg.layers) for leg in topo.legs] == [(RankId(0, 0), (0, 3)), (RankId(1, 0), (3, 5))]
    assert even_layer_windows(4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"p_tp": 3, "num_kv_heads": 4}, "one must divide the other"),
        ({"d_tp": 6, "num_kv_heads": 4}, "one must divide the other"),
        ({"p_pp": 3, "num_layers": 2}, "cannot split 2 layers"),
        ({"layer_windows": ((0, 1), (2, 4)), "p_pp": 2}, "do not tile"),
    ],
)
def test_what_cannot_be_split_is_refused_with_the_reason(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"p_tp": 1, "d_tp": 1, "num_kv_heads": 4, "head_bytes": 8, "num_layers": 4}
    with pytest.raises(TopologyError, match=message):
        plan(**{**args, **kwargs})  # type: ignore[arg-type]
