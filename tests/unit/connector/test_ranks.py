"""connector.ranks: which legs a rank runs, its ports, what a P rank writes into a D rank, and what is refused."""

from __future__ import annotations

import pytest

from connector.metadata import KVLayout, PeerAddress, RankInfo, Region
from connector.ranks import Unpairable, decode_legs, prefill_slices, prefill_targets, rank_port
from connector.topology import RankId, Slice, heads_of

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
        (PeerAddress("p0", "h", 5600, pp_size=2), RankInfo(), "pipeline_parallel_size 2"),
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
