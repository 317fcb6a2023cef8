"""Descriptor arithmetic: numpy lists equal the block-by-block definition, indices, tails, ranges."""

from __future__ import annotations

import numpy as np
import pytest

from connector.transfer.layout import (
    block_bytes,
    coalesced_ranges,
    descriptor_indices,
    num_descriptors,
    pair_blocks,
    region_descriptors,
    strided_descriptors,
)
from connector.wire.metadata import KVLayout, Region

GIB = 2**30


def layout_of(*regions: Region, device_id: int = 0) -> KVLayout:
    return KVLayout("VRAM", device_id, 16, regions)


# Three layers of 6 blocks (one backing buffer, back to back) and one odd region elsewhere.
LAYERS = layout_of(
    Region(64 * GIB, 4096, 6),
    Region(64 * GIB + 6 * 4096, 4096, 6),
    Region(64 * GIB + 12 * 4096, 4096, 6),
    device_id=3,
)


def by_definition(layout: KVLayout) -> list[tuple[int, int, int]]:
    """Block b of region r at base + b * block_len, region-major: what both sides must agree on."""
    return [
        (r.base + b * r.block_len, r.block_len, layout.device_id) for r in layout.regions for b in range(r.num_blocks)
    ]


def test_region_descriptors_are_every_block_of_every_region_region_major() -> None:
    descs = region_descriptors(LAYERS)
    assert descs.dtype == np.uint64 and descs.shape == (18, 3)
    assert [tuple(int(x) for x in row) for row in descs] == by_definition(LAYERS)
    assert num_descriptors(LAYERS) == 18


def test_regions_of_unequal_size_keep_the_region_major_order() -> None:
    layout = layout_of(Region(1 << 40, 512, 3), Region(5 << 40, 128, 5))
    assert [tuple(int(x) for x in row) for row in region_descriptors(layout)] == by_definition(layout)


def test_strided_rows_expand_to_the_same_list() -> None:
    rows = strided_descriptors(LAYERS)
    assert rows.dtype == np.uint64 and rows.shape == (3, 5)
    expanded = [
        (int(base) + i * int(stride), int(length), int(dev))
        for base, length, dev, stride, count in rows
        for i in range(int(count))
    ]
    assert expanded == by_definition(LAYERS)


def test_descriptor_indices_select_the_block_in_every_region() -> None:
    idx = descriptor_indices(LAYERS, (4, 1, 5))
    assert idx.dtype == np.int32
    assert idx.tolist() == [4, 1, 5, 10, 7, 11, 16, 13, 17]
    descs = by_definition(LAYERS)
    assert [descs[i][0] for i in idx[:3]] == [64 * GIB + b * 4096 for b in (4, 1, 5)]


def test_descriptor_indices_accept_numpy_block_ids_and_nothing() -> None:
    assert descriptor_indices(LAYERS, np.array([2, 3])).tolist() == [2, 3, 8, 9, 14, 15]
    assert descriptor_indices(LAYERS, ()).size == 0


@pytest.mark.parametrize("bad", [-1, 6, 100])
def test_a_block_id_outside_the_cache_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=f"block id {bad} outside region of 6 blocks"):
        descriptor_indices(LAYERS, (0, bad))


def test_a_block_id_beyond_the_smallest_region_is_refused() -> None:
    layout = layout_of(Region(1 << 40, 512, 8), Region(5 << 40, 512, 4))
    with pytest.raises(ValueError, match="outside region of 4 blocks"):
        descriptor_indices(layout, (5,))


def test_pair_blocks_aligns_the_tails() -> None:
    assert pair_blocks((1, 2, 3, 4), (8, 9)) == ((3, 4), (8, 9))
    assert pair_blocks((1,), (7, 8, 9)) == ((1,), (9,))
    assert pair_blocks((), (1,)) == ((), ())


def test_pair_blocks_orders_the_pairs_by_the_local_id_keeping_each_pair() -> None:
    """Blocks vLLM handed out tail first (descending on both sides) pair up ascending on both: one run."""
    assert pair_blocks((8, 7, 6, 5), (20, 19, 18, 17)) == ((5, 6, 7, 8), (17, 18, 19, 20))
    assert pair_blocks((3, 9, 1), (4, 5, 6)) == ((1, 3, 9), (6, 4, 5))
    assert pair_blocks((9, 8, 7, 6), (31, 30)) == ((6, 7), (30, 31)), "tails aligned first, then ordered"


def test_block_bytes_sum_over_regions() -> None:
    assert block_bytes(LAYERS) == 3 * 4096


def test_back_to_back_layers_coalesce_into_one_registration_range() -> None:
    ranges = coalesced_ranges(LAYERS)
    assert ranges.dtype == np.uint64
    assert ranges.tolist() == [[64 * GIB, 18 * 4096, 3]]


def test_separate_buffers_stay_separate_and_overlaps_merge() -> None:
    layout = layout_of(Region(3000, 100, 2), Region(1000, 100, 2), Region(1100, 100, 4))
    assert coalesced_ranges(layout).tolist() == [[1000, 500, 0], [3000, 200, 0]]


def test_sliced_rows_address_each_slice_of_each_block_in_index_order() -> None:
    from connector.transfer.layout import sliced_layout, sliced_strided_descriptors

    layout = KVLayout("DRAM", 0, 16, (Region(1000, 40, 3), Region(5000, 40, 3)))
    parts = [(10, 10), (30, 10)]
    rows = sliced_strided_descriptors(layout, parts)
    expanded = [
        (int(base) + i * int(stride), int(length)) for base, length, _, stride, count in rows for i in range(int(count))
    ]
    idx = descriptor_indices(sliced_layout(layout, parts), [2, 0])
    got = [expanded[i] for i in idx]
    assert got == [(1090, 10), (1010, 10), (1110, 10), (1030, 10), (5090, 10), (5010, 10), (5110, 10), (5030, 10)]
    with pytest.raises(ValueError, match="outside a block"):
        sliced_strided_descriptors(layout, [(35, 10)])
