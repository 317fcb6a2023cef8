"""Runs of blocks consecutive on both sides (``connector.transfer.layout.block_runs`` / ``run_descriptors``):
examples, and
a property over random block tables on both sides, TP head slices and layer windows: every destination byte the
per-block definition writes is written exactly once, from the right source byte, and nothing else is written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.transfer.layout import (
    Part,
    block_runs,
    pair_blocks,
    posted_descriptors,
    run_descriptors,
    run_shape,
    runs_as_lists,
)
from connector.wire.metadata import KVLayout, Region


def layout(base: int, block_len: int, num_blocks: int, num_regions: int, gap: int = 0, dev: int = 0) -> KVLayout:
    span = block_len * num_blocks + gap
    return KVLayout("DRAM", dev, 16, tuple(Region(base + i * span, block_len, num_blocks) for i in range(num_regions)))


def rows(got: tuple[np.ndarray, np.ndarray]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    loc, rem = got
    return [((int(a[0]), int(a[1])), (int(b[0]), int(b[1]))) for a, b in zip(loc, rem, strict=True)]


def test_runs_break_where_either_side_stops_being_consecutive() -> None:
    starts_l, starts_r, lengths = block_runs((3, 4, 5, 9, 10, 11, 12), (7, 8, 20, 21, 22, 23, 30))
    assert (starts_l.tolist(), starts_r.tolist(), lengths.tolist()) == ([3, 5, 9, 12], [7, 20, 21, 30], [2, 1, 3, 1])
    assert [x.tolist() for x in block_runs((), ())] == [[], [], []]
    with pytest.raises(ValueError, match="paired"):
        block_runs((1, 2), (3,))


def test_a_step_down_on_one_side_breaks_a_run() -> None:
    assert block_runs((5, 4, 5, 6), (1, 2, 3, 4))[2].tolist() == [1, 3]
    assert block_runs((1, 2, 3), (9, 8, 7))[2].tolist() == [1, 1, 1]


def test_a_run_is_one_row_per_region_on_each_side() -> None:
    p, d = layout(1000, 10, 8, 2, gap=5), layout(5000, 10, 8, 2, gap=5)
    got = rows(run_descriptors(p, d, (1, 2, 3, 6), (4, 5, 6, 0)))
    assert got == [
        ((1010, 30), (5040, 30)),
        ((1060, 10), (5000, 10)),
        ((1095, 30), (5125, 30)),
        ((1145, 10), (5085, 10)),
    ]


def test_a_layer_window_writes_only_its_regions() -> None:
    p, d = layout(1000, 10, 8, 3, gap=5), layout(5000, 10, 8, 3, gap=5)
    assert rows(run_descriptors(p, d, (1, 2), (4, 5), regions=(1, 2))) == [((1095, 20), (5125, 20))]


def test_runs_stay_apart_across_regions_that_touch_as_nixl_keeps_them() -> None:
    p, d = layout(1000, 10, 4, 2), layout(5000, 10, 4, 2)  # regions back to back on both sides
    assert rows(run_descriptors(p, d, (0, 1, 2, 3), (0, 1, 2, 3))) == [
        ((1000, 40), (5000, 40)),
        ((1040, 40), (5040, 40)),
    ]


def test_head_slices_narrower_than_the_block_stay_one_row_per_block() -> None:
    p, d = layout(1000, 8, 4, 1), layout(5000, 16, 4, 1)  # P tp 2 into D tp 1: P's whole block is half of D's
    got = rows(run_descriptors(p, d, (1, 2), (1, 2), parts=((0, 8, 8),)))
    assert got == [((1008, 8), (5024, 8)), ((1016, 8), (5040, 8))]


def test_an_id_outside_either_cache_is_refused() -> None:
    p, d = layout(1000, 10, 8, 1), layout(5000, 10, 4, 1)
    with pytest.raises(ValueError, match="block id 4 outside region of 4 blocks"):
        run_descriptors(p, d, (0, 1), (3, 4))


def test_nothing_to_write_is_no_rows() -> None:
    p = layout(1000, 10, 8, 2)
    assert [x.shape for x in run_descriptors(p, p, (), ())] == [(0, 3), (0, 3)]


# ---- the property -------------------------------------------------------------------------------------------

Case = tuple[KVLayout, KVLayout, list[int], list[int], tuple[Part, ...] | None, tuple[int, int]]


@st.composite
def tables(
    draw: st.DrawFn,
) -> tuple[KVLayout, KVLayout, list[int], list[int], tuple[Part, ...] | None, tuple[int, int]]:
    num_regions = draw(st.integers(1, 3))
    p_blocks, d_blocks = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    sliced = draw(st.booleans())
    if sliced:  # heads of `unit` bytes: P holds hp heads a block, D hd; each part moves some heads
        unit, hp, hd = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
        k = draw(st.integers(1, min(hp, hd)))
        src = sorted(draw(st.lists(st.integers(0, hp - 1), min_size=k, max_size=k, unique=True)))
        dst = draw(st.permutations(draw(st.lists(st.integers(0, hd - 1), min_size=k, max_size=k, unique=True))))
        parts: tuple[Part, ...] | None = tuple((s * unit, d * unit, unit) for s, d in zip(src, dst, strict=True))
        p_len, d_len = hp * unit, hd * unit
    else:
        parts, p_len = None, draw(st.integers(1, 6))
        d_len = p_len
    p = layout(1000, p_len, p_blocks, num_regions, gap=draw(st.sampled_from([0, 3])))
    d = layout(100_000, d_len, d_blocks, num_regions, gap=draw(st.sampled_from([0, 5])), dev=1)
    n = draw(st.integers(0, min(p_blocks, d_blocks)))
    consecutive = draw(st.booleans())
    local = draw(st.permutations(range(p_blocks)))[:n]
    remote = draw(st.permutations(range(d_blocks)))[:n]
    if consecutive and n:
        lo_p, lo_d = draw(st.integers(0, p_blocks - n)), draw(st.integers(0, d_blocks - n))
        local, remote = list(range(lo_p, lo_p + n)), list(range(lo_d, lo_d + n))
    lo = draw(st.integers(0, num_regions - 1))
    window = (lo, draw(st.integers(lo + 1, num_regions)))
    return p, d, local, remote, parts, window


def by_definition(
    p: KVLayout,
    d: KVLayout,
    local: list[int],
    remote: list[int],
    parts: tuple[Part, ...] | None,
    window: tuple[int, int],
) -> dict[int, int]:
    """Destination byte -> source byte, block by block, slice by slice."""
    out: dict[int, int] = {}
    for lr, rr in list(zip(p.regions, d.regions, strict=True))[window[0] : window[1]]:
        for src, dst, length in parts or ((0, 0, lr.block_len),):
            for lb, rb in zip(local, remote, strict=True):
                for k in range(length):
                    out[rr.base + rb * rr.block_len + dst + k] = lr.base + lb * lr.block_len + src + k
    return out


@settings(max_examples=300, deadline=None)
@given(tables())
def test_every_destination_byte_is_written_exactly_once_from_the_right_source(
    case: Case,
) -> None:
    p, d, local, remote, parts, window = case
    loc, rem = run_descriptors(p, d, local, remote, parts=parts, regions=window)
    written: dict[int, int] = {}
    for (la, ll, ldev), (ra, rl, rdev) in zip(loc.tolist(), rem.tolist(), strict=True):
        assert ll == rl and ll > 0 and (ldev, rdev) == (0, 1)
        for k in range(ll):
            assert ra + k not in written, "a destination byte written twice"
            written[ra + k] = la + k
    assert written == by_definition(p, d, local, remote, parts, window)
    assert posted_descriptors(p, d, local, remote, parts, window) == len(loc)
    runs, p_len, d_len = len(block_runs(local, remote)[2]), p.regions[0].block_len, d.regions[0].block_len
    per_region = sum(runs if n == p_len == d_len else len(local) for _, _, n in parts or ((0, 0, p_len),))
    assert len(loc) == per_region * (window[1] - window[0]), "one row per run (sliced: per block) per part, region"


def test_a_part_whole_in_some_regions_only_merges_there() -> None:
    p = KVLayout("DRAM", 0, 16, (Region(1000, 10, 4), Region(2000, 20, 4)))
    d = KVLayout("DRAM", 0, 16, (Region(5000, 10, 4), Region(6000, 20, 4)))
    got = rows(run_descriptors(p, d, (1, 2), (2, 3), parts=((0, 0, 10),)))
    assert got == [((1010, 20), (5020, 20)), ((2020, 10), (6040, 10)), ((2040, 10), (6060, 10))]
    assert posted_descriptors(p, d, (1, 2), (2, 3), parts=((0, 0, 10),)) == 3


def test_the_count_without_rows_equals_the_rows() -> None:
    p, d = layout(1000, 10, 8, 3, gap=5), layout(5000, 10, 8, 3, gap=5)
    for local, remote, window in [((1, 2, 3, 6), (4, 5, 6, 0), None), ((0, 2), (5, 7), (1, 3)), ((), (), None)]:
        want = len(run_descriptors(p, d, local, remote, regions=window)[0])
        assert posted_descriptors(p, d, local, remote, regions=window) == want


def test_long_runs_go_as_per_request_lists_short_ones_indexed() -> None:
    assert runs_as_lists(1, 1024) and runs_as_lists(10, 40)
    assert not runs_as_lists(10, 39) and not runs_as_lists(1024, 1024) and not runs_as_lists(0, 0)


def test_run_shape_counts_runs_on_each_side_and_on_both() -> None:
    shape = run_shape((3, 4, 5, 6), (9, 10, 2, 3))
    assert shape.prefill == ((4, 1),)  # consecutive on P
    assert shape.decode == ((2, 2),)  # D breaks after the second block
    assert shape.both == ((2, 2),)
    assert run_shape((), ()).both == ()


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_run_shape_partitions_the_pairs_and_both_sides_refine_each_side(pairs: list[tuple[int, int]]) -> None:
    local, remote = [p for p, _ in pairs], [d for _, d in pairs]
    shape = run_shape(local, remote)
    for lengths in (shape.prefill, shape.decode, shape.both):
        assert sum(n * c for n, c in lengths) == len(pairs)
    prefill, decode, both = (sum(c for _, c in lengths) for lengths in (shape.prefill, shape.decode, shape.both))
    assert both >= max(prefill, decode)
    assert both == block_runs(local, remote)[2].size


def test_blocks_handed_out_tail_first_are_one_run_once_paired() -> None:
    """After churn vLLM's free queue gives a request descending ids on P and on D: paired, one run per region."""
    p, d = layout(0x10000, 64, 100, 4), layout(0x900000, 64, 100, 4)
    local, remote = pair_blocks(tuple(range(40, 32, -1)), tuple(range(90, 82, -1)))
    assert run_shape(local, remote).both == ((8, 1),)
    assert posted_descriptors(p, d, local, remote) == 4, "one descriptor per region, not 8"
    assert run_shape(tuple(range(40, 32, -1)), tuple(range(90, 82, -1))).both == ((1, 8),), "unpaired: 8 runs"
