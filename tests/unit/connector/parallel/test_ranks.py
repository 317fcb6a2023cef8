"""connector.parallel.ranks: which legs a rank runs, its ports, what a P rank writes into a D rank, and what is
refused."""

from __future__ import annotations

import pytest

from connector.parallel.ranks import (
    Unpairable,
    decode_legs,
    layer_window,
    prefill_slices,
    prefill_targets,
    rank_port,
    stage_window,
)
from connector.parallel.topology import Slice, heads_of
from connector.wire.metadata import KVLayout, PeerAddress, RankId, RankInfo, Region

HEADS, HB = 4, 16


def info(tp: int, rank: int, heads: int = HEADS, hb: int = HB) -> RankInfo:
    return RankInfo(tp, 1, RankId(0, rank), heads, heads_of(rank, tp, heads), hb, (0, 2))


def layout(tp: int, block_len: int | None = None, regions: int = 2) -> KVLayout:
    n = block_len if block_len is not None else len(heads_of(0, tp, HEADS)) * HB
    return KVLayout("DRAM", 0, 16, tuple(Region(1000 * i, n, 8) for i in range(regions)))


PEER = PeerAddress("p0", "h", 5600)


def test_equal_tp_is_one_leg_to_the_same_numbered_rank_on_its_own_port() -> None:
    legs = decode_legs("d1", PeerAddress("p0", "h", 5600, tp_size=2), info(2, 1))
    assert legs == (("d1", PeerAddress("p0", "h", 5601, 2, 1, RankId(0, 1))),)
    assert decode_legs("d1", PEER, RankInfo()) == (("d1", PEER),)  # TP = 1: the request id and address as before


def test_a_d_rank_fed_by_several_p_ranks_gets_one_leg_per_source_with_its_port() -> None:
    legs = decode_legs("d1", PeerAddress("p0", "h", 5600, tp_size=4), info(2, 1))
    assert [(leg, p.rank, p.port) for leg, p in legs] == [
        ("d1@0.2", RankId(0, 2), 5602),
        ("d1@0.3", RankId(0, 3), 5603),
    ]
    assert rank_port(5600, RankId(1, 1), 4) == 5605


@pytest.mark.parametrize(
    ("peer", "mine", "says"),
    [
        (PeerAddress("p0", "h", 5600), RankInfo(1, 2, RankId(1, 0)), "decode pipeline_parallel_size 2"),
        (PeerAddress("p0", "h", 5600, tp_size=2), RankInfo(), "heads are unknown"),
        (PeerAddress("p0", "h", 5600, tp_size=3), info(1, 0), "one must divide the other"),
    ],
)
def test_what_a_d_rank_cannot_pair_is_refused_with_the_reason(peer: PeerAddress, mine: RankInfo, says: str) -> None:
    with pytest.raises(Unpairable, match=says):
        decode_legs("d1", peer, mine)


def test_a_p_rank_writes_whole_blocks_at_equal_tp_and_its_heads_slice_otherwise() -> None:
    assert prefill_slices(info(2, 1), info(2, 1), layout(2), layout(2)) is None
    assert prefill_slices(info(2, 1), info(1, 0), layout(2), layout(1)) == (Slice(0, 2 * HB, 2 * HB),)
    assert prefill_slices(info(4, 3), info(2, 1), layout(4), layout(2)) == (Slice(0, HB, HB),)
    # P_tp < D_tp: a slice of the P rank's block (the D rank's heads) into the whole D block
    assert prefill_slices(info(1, 0), info(2, 1), layout(1), layout(2)) == (Slice(2 * HB, 0, 2 * HB),)
    assert prefill_slices(info(2, 1), info(4, 3), layout(2), layout(4)) == (Slice(HB, 0, HB),)


def test_under_p_tp_below_d_tp_each_d_rank_has_one_source_and_a_p_rank_several_targets() -> None:
    legs = decode_legs("d1", PeerAddress("p0", "h", 5600, tp_size=2), info(4, 3))
    assert [(leg, p.rank, p.port) for leg, p in legs] == [("d1", RankId(0, 1), 5601)]  # one source: the request id
    assert prefill_targets(info(2, 1), info(4, 0)) == (2, 3)
    assert prefill_targets(info(1, 0), info(4, 0)) == (0, 1, 2, 3)
    assert prefill_targets(info(2, 1), info(2, 0)) == (1,)
    assert prefill_targets(info(4, 2), info(2, 0)) == (1,)
    # replicated KV heads (tp > heads): 1 P rank holding both of 2 heads writes each of 4 D ranks
    two = RankInfo(1, 1, RankId(0, 0), 2, (0, 1), HB, (0, 2))
    assert prefill_targets(two, RankInfo(4, 1, RankId(0, 0), 2, heads_of(0, 4, 2), HB, (0, 2))) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("mine", "theirs", "my_layout", "their_layout", "says"),
    [
        (info(2, 0), info(2, 1), layout(2), layout(2), "not the source of decode rank 1"),
        (info(2, 0), info(2, 0), layout(2), layout(2, block_len=8), "block lengths differ"),
        (info(2, 0), info(2, 0), layout(2), layout(2, regions=3), "2 regions"),
        (info(2, 0), info(1, 0, hb=8), layout(2), layout(1), "KV heads x bytes per head"),
        (info(2, 0), info(1, 0), layout(2, block_len=40), layout(1), "not heads x bytes per head"),
        (info(2, 1), info(4, 0), layout(2), layout(4), "writes nothing into decode rank 0"),
    ],
)
def test_a_p_rank_refuses_a_d_rank_whose_geometry_does_not_fit_naming_why(
    mine: RankInfo, theirs: RankInfo, my_layout: KVLayout, their_layout: KVLayout, says: str
) -> None:
    with pytest.raises(Unpairable, match=says):
        prefill_slices(mine, theirs, my_layout, their_layout)


def test_a_pp_prefill_is_one_source_per_stage_each_writing_its_layers_regions() -> None:
    legs = decode_legs("d1", PeerAddress("p0", "h", 5600, tp_size=2, pp_size=2), info(2, 1))
    assert [(leg, p.rank, p.port) for leg, p in legs] == [
        ("d1@0.1", RankId(0, 1), 5601),
        ("d1@1.1", RankId(1, 1), 5603),  # stage 1's rank 1: + pp x TP + tp
    ]
    stage1 = RankInfo(2, 2, RankId(1, 1), HEADS, heads_of(1, 2, HEADS), HB, (3, 5))
    decode = RankInfo(2, 1, RankId(0, 1), HEADS, heads_of(1, 2, HEADS), HB, (0, 5))
    window = stage_window(stage1, decode, layout(2, regions=2), layout(2, regions=5))
    assert [r.base for r in window.regions] == [3000, 4000]  # the decode's regions of layers 3 and 4
    assert prefill_slices(stage1, decode, layout(2, regions=2), window) is None  # equal TP: whole blocks
    assert stage_window(info(2, 1), decode, layout(2), layout(2, regions=5)).regions == layout(2, regions=5).regions


@pytest.mark.parametrize(
    ("layers", "regions", "d_regions", "says"),
    [((3, 6), 2, 5, "do not fit"), ((0, 0), 2, 5, "do not fit"), ((0, 2), 2, 3, "1 region\\(s\\) per layer here")],
)
def test_a_stage_whose_layers_do_not_fit_the_decode_is_refused(
    layers: tuple[int, int], regions: int, d_regions: int, says: str
) -> None:
    stage = RankInfo(2, 2, RankId(0, 0), HEADS, heads_of(0, 2, HEADS), HB, layers)
    decode = RankInfo(2, 1, RankId(0, 0), HEADS, heads_of(0, 2, HEADS), HB, (0, 5))
    with pytest.raises(Unpairable, match=says):
        stage_window(stage, decode, layout(2, regions=regions), layout(2, regions=d_regions))


def test_a_ranks_layer_window_comes_from_its_layer_names() -> None:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in (4, 5, 6))
    assert layer_window(names, 2) == (4, 7)
    assert layer_window(names, 1) == (0, 3)  # PP 1: every layer, numbered from 0
    assert layer_window(("model.layers.1.attn", "model.layers.3.attn"), 2) == (0, 0)  # not contiguous
