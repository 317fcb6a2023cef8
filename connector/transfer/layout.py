"""Pure block-id -> descriptor arithmetic over a ``KVLayout``, vectorised with numpy (no NIXL, no torch).

Descriptor order is region-major on both sides: descriptor ``r * num_blocks + b`` is block ``b`` of
region ``r`` (with regions of unequal size, region ``r`` starts after the blocks of regions
``0..r-1``). A block pair therefore maps to the same index arithmetic on P and on D.

A WRITE's descriptors merge runs: block pairs consecutive on both sides are one contiguous range per region on
each side (``block_runs``, ``run_descriptors``), which is what NIXL 1.5's ``make_prepped_xfer`` posts for a
per-block index list (it merges index entries contiguous on both sides; ``connector/README.md``, "Descriptors at
scale").

Everything returned here is a numpy array in the dtypes NIXL's Python API takes without a copy
per element: descriptor lists are ``(N, 3)`` (or ``(R, 5)`` strided) ``uint64`` arrays, index lists
``int32`` arrays. At GPU scale (64 layers x 60k blocks = 3.8 M descriptors) building the list is
one ``arange`` per region instead of one Python tuple per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from connector.transfer.base import Lengths, RunShape
from connector.wire.metadata import KVLayout, Region

DescArray = npt.NDArray[np.uint64]
IndexArray = npt.NDArray[np.int32]

MAX_DESCRIPTORS = 2**31 - 1  # NIXL indexes descriptors with int32


def num_descriptors(layout: KVLayout) -> int:
    """Length of ``region_descriptors(layout)``: every block of every region."""
    return sum(r.num_blocks for r in layout.regions)


def region_descriptors(layout: KVLayout) -> DescArray:
    """Every block of every region as rows ``(address, length, device id)``, region-major.

    An ``(N, 3)`` ``uint64`` array, accepted as is by NIXL's ``prep_xfer_dlist`` (with the memory
    type) for the local side (``"NIXL_INIT_AGENT"``) and for a peer's side.
    """
    total = num_descriptors(layout)
    if total > MAX_DESCRIPTORS:
        raise ValueError(f"{total} descriptors exceed NIXL's int32 index range")
    out = np.empty((total, 3), dtype=np.uint64)
    row = 0
    for region in layout.regions:
        end = row + region.num_blocks
        out[row:end, 0] = np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(region.block_len)
        out[row:end, 0] += np.uint64(region.base)
        out[row:end, 1] = region.block_len
        row = end
    out[:, 2] = layout.device_id
    return out


def strided_descriptors(layout: KVLayout) -> DescArray:
    """The same list in NIXL's compressed form: one row ``(base, block_len, device id, stride, count)``
    per region (``stride == block_len``: blocks are dense).

    NIXL 1.5's ``prep_xfer_dlist`` expands an ``(R, 5)`` array to exactly the rows of
    ``region_descriptors`` in the same order (checked on two agents by
    ``tests/integration/connector/test_gpu_check_cpu.py``), so indices are unchanged and Python builds
    R rows instead of R * num_blocks. The memory type must be passed with it.
    """
    out = np.empty((len(layout.regions), 5), dtype=np.uint64)
    for i, region in enumerate(layout.regions):
        out[i] = (region.base, region.block_len, layout.device_id, region.block_len, region.num_blocks)
    return out


def sliced_strided_descriptors(layout: KVLayout, parts: Sequence[tuple[int, int]]) -> DescArray:
    """Compact rows for byte ranges inside each block (head slices under TP, ``connector.parallel.topology``): for each
    region, for each part ``(offset, length)``, ``(base + offset, length, device id, block_len, num_blocks)``.
    Index with ``descriptor_indices(sliced_layout(layout, parts), block_ids)``."""
    out = np.empty((len(layout.regions) * len(parts), 5), dtype=np.uint64)
    row = 0
    for region in layout.regions:
        for offset, length in parts:
            if offset < 0 or length < 1 or offset + length > region.block_len:
                raise ValueError(f"slice ({offset}, {length}) outside a block of {region.block_len} bytes")
            out[row] = (region.base + offset, length, layout.device_id, region.block_len, region.num_blocks)
            row += 1
    return out


def sliced_layout(layout: KVLayout, parts: Sequence[tuple[int, int]]) -> KVLayout:
    """The layout as ``sliced_strided_descriptors`` lists it (one region per region x part), for
    ``descriptor_indices``: only block counts and order matter there, not addresses."""
    regions = tuple(Region(r.base + off, length, r.num_blocks) for r in layout.regions for off, length in parts)
    return KVLayout(layout.mem_type, layout.device_id, layout.block_size, regions)


def descriptor_indices(layout: KVLayout, block_ids: Sequence[int] | npt.NDArray[np.integer]) -> IndexArray:
    """Indices into ``region_descriptors(layout)`` for ``block_ids`` in every region, region-major:
    ``[r0:b0, r0:b1, ..., r1:b0, ...]``; an ``int32`` array for NIXL's ``make_prepped_xfer``."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if not layout.regions or ids.size == 0:
        return np.empty(0, dtype=np.int32)
    sizes = np.fromiter((r.num_blocks for r in layout.regions), dtype=np.int64, count=len(layout.regions))
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= int(sizes.min()):
        bad = lo if lo < 0 else hi
        raise ValueError(f"block id {bad} outside region of {int(sizes.min())} blocks")
    if int(sizes.sum()) > MAX_DESCRIPTORS:
        raise ValueError(f"{int(sizes.sum())} descriptors exceed NIXL's int32 index range")
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return (offsets[:, None] + ids[None, :]).reshape(-1).astype(np.int32)


def pair_blocks(local: Sequence[int], remote: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Align the tails (decode may already hold a prefix: a local cache hit registers fewer blocks), then order
    the pairs by the local block id. vLLM frees a request's blocks tail first and hands them out again from the
    same queue, so after churn a request often gets runs of ids in *descending* order on both sides: ordered
    by P's id, each pair unchanged, those become runs ascending on both sides (one descriptor per region
    instead of one per block). Every pair keeps its source and destination; only the WRITE's order changes."""
    n = min(len(local), len(remote))
    pairs = sorted(zip(local[len(local) - n :], remote[len(remote) - n :], strict=True))
    return tuple(p for p, _ in pairs), tuple(d for _, d in pairs)


def block_bytes(layout: KVLayout) -> int:
    """Bytes one block id stands for, across all regions."""
    return sum(r.block_len for r in layout.regions)


def coalesced_ranges(layout: KVLayout) -> DescArray:
    """The regions' memory merged into maximal ranges ``(address, length, device id)``.

    Regions that touch or overlap become one range. For vLLM 0.32's layer-compact layouts (every
    layer's blocks back to back in one backing buffer) that is one range per backing buffer, so this
    is a registration list when the buffers themselves are not known (``connector.kvcache`` knows
    them exactly: ``KVCaches.registrations``).
    """
    spans = sorted((r.base, r.base + r.block_len * r.num_blocks) for r in layout.regions if r.num_blocks)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = np.empty((len(merged), 3), dtype=np.uint64)
    for i, (start, end) in enumerate(merged):
        out[i] = (start, end - start, layout.device_id)
    return out


RunArrays = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
Part = tuple[int, int, int]  # (offset in a local block, offset in a remote block, length): a TP head slice


def block_runs(
    local: Sequence[int] | npt.NDArray[np.integer], remote: Sequence[int] | npt.NDArray[np.integer]
) -> RunArrays:
    """Maximal runs, in request order, of block pairs consecutive on both sides: ``(local starts, remote
    starts, lengths)``. Pairs ``i`` and ``i + 1`` share a run iff ``local[i + 1] == local[i] + 1`` and
    ``remote[i + 1] == remote[i] + 1``."""
    lb = np.asarray(local, dtype=np.int64).reshape(-1)
    rb = np.asarray(remote, dtype=np.int64).reshape(-1)
    if lb.size != rb.size:
        raise ValueError(f"{lb.size} local blocks paired with {rb.size} remote blocks")
    if lb.size == 0:
        return lb, rb, np.empty(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(lb) != 1) | (np.diff(rb) != 1)) + 1))
    lengths = np.diff(np.append(starts, lb.size))
    return lb[starts], rb[starts], lengths


def _lengths(breaks: npt.NDArray[np.bool_], size: int) -> Lengths:
    """``(length, count)`` of the runs that ``breaks`` (True where pair ``i + 1`` starts a new run) cut ``size``
    pairs into."""
    if size == 0:
        return ()
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    values, counts = np.unique(np.diff(np.append(starts, size)), return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist(), strict=True))


def run_shape(
    local: Sequence[int] | npt.NDArray[np.integer], remote: Sequence[int] | npt.NDArray[np.integer]
) -> RunShape:
    """The run lengths of a WRITE's paired block ids on P (``local``), on D (``remote``) and on both at once."""
    lb = np.asarray(local, dtype=np.int64).reshape(-1)
    rb = np.asarray(remote, dtype=np.int64).reshape(-1)
    on_p, on_d = np.diff(lb) != 1, np.diff(rb) != 1
    return RunShape(_lengths(on_p, lb.size), _lengths(on_d, rb.size), _lengths(on_p | on_d, lb.size))


def run_descriptors(
    local: KVLayout,
    remote: KVLayout,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
    parts: Sequence[Part] | None = None,
    regions: tuple[int, int] | None = None,
) -> tuple[DescArray, DescArray]:
    """The ``(address, length, device id)`` rows of a WRITE of ``local_blocks`` into ``remote_blocks``, both
    sides, row ``i`` of one side paired with row ``i`` of the other.

    Order is NIXL's index order (region-major, then part, then block pairs in request order). A run of whole
    blocks (``block_runs``) is one row per region; a head slice (``parts``, ``connector.parallel.topology``)
    narrower than its block is not contiguous with the next block's, so sliced blocks stay one row each. Rows
    are what NIXL 1.5 posts for the per-block index list: it merges entries contiguous on both sides within one
    prepared region, not across regions even where they touch (``tests/integration/connector/test_nixl_runs.py``).
    ``regions``: only regions ``[lo, hi)`` (one per layer: a layer window of layer-wise push); None: all."""
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    rb = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
    _check_ids(local, lb)
    _check_ids(remote, rb)
    runs, blocks = block_runs(lb, rb), (lb, rb, np.ones(lb.size, dtype=np.int64))
    segs = _segments(local, remote, parts, regions)
    sizes = [runs[2].size if merge else lb.size for *_, merge in segs]
    out_l, out_r = np.empty((sum(sizes), 3), dtype=np.uint64), np.empty((sum(sizes), 3), dtype=np.uint64)
    out_l[:, 2], out_r[:, 2] = local.device_id, remote.device_id
    if len({merge for *_, merge in segs}) == 1:  # every segment alike (the usual case): one broadcast
        _fill(out_l, out_r, np.array([seg[:5] for seg in segs], dtype=np.int64), runs if segs[0][5] else blocks)
        return out_l, out_r
    row = 0
    for seg, size in zip(segs, sizes, strict=True):
        rows = slice(row, row + size)
        _fill(out_l[rows], out_r[rows], np.array([seg[:5]], dtype=np.int64), runs if seg[5] else blocks)
        row += size
    return out_l, out_r


def posted_descriptors(
    local: KVLayout,
    remote: KVLayout,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    parts: Sequence[Part] | None = None,
    regions: tuple[int, int] | None = None,
) -> int:
    """How many rows ``run_descriptors`` returns (the descriptors NIXL posts), without building them."""
    runs = block_runs(local_blocks, remote_blocks)[2].size
    return sum(runs if merge else len(local_blocks) for *_, merge in _segments(local, remote, parts, regions))


RUNS_AS_LISTS_MIN_MEAN = 4  # blocks per run from which a per-request run list beats indexing (loadtest.micro)


def runs_as_lists(num_runs: int, num_pairs: int) -> bool:
    """Whether a WRITE of ``num_pairs`` block pairs in ``num_runs`` runs goes as a per-request list of its runs
    (``run_descriptors``): building rows for long runs is cheaper than indexing every block and letting NIXL
    merge them; for short runs NIXL's per-descriptor check of a new list costs more than the indexing."""
    return num_runs > 0 and num_pairs >= RUNS_AS_LISTS_MIN_MEAN * num_runs


Segment = tuple[int, int, int, int, int, bool]  # local base, remote base, local / remote block_len, length, merges


def _segments(
    local: KVLayout, remote: KVLayout, parts: Sequence[Part] | None, regions: tuple[int, int] | None
) -> list[Segment]:
    """One per (region, part) in index order; a part as long as the block on both sides merges runs."""
    pairs = list(zip(local.regions, remote.regions, strict=True))[slice(*(regions or (None, None)))]
    return [
        (lr.base + src, rr.base + dst, lr.block_len, rr.block_len, length, length == lr.block_len == rr.block_len)
        for lr, rr in pairs
        for src, dst, length in parts or ((0, 0, lr.block_len),)
    ]


def _fill(out_l: DescArray, out_r: DescArray, segs: npt.NDArray[np.int64], ids: RunArrays) -> None:
    """Rows of segments (``Segment`` columns 0-4) x pairs (``ids``: local, remote starts, lengths), in place."""
    if out_l.size == 0:
        return
    ls, rs, n = ids
    shape = (len(segs), ls.size)
    for out, starts, base, block_len in ((out_l, ls, segs[:, 0], segs[:, 2]), (out_r, rs, segs[:, 1], segs[:, 3])):
        addr = out.reshape(*shape, 3)[:, :, 0]  # a view: written in place, no temporary of the full size
        np.multiply(starts[None, :], block_len[:, None], out=addr, casting="unsafe")
        np.add(addr, base[:, None].astype(np.uint64), out=addr)
        np.multiply(n[None, :], segs[:, 4, None], out=out.reshape(*shape, 3)[:, :, 1], casting="unsafe")


def _check_ids(layout: KVLayout, ids: npt.NDArray[np.int64]) -> None:
    if ids.size and layout.regions:
        smallest = min(r.num_blocks for r in layout.regions)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= smallest:
            raise ValueError(f"block id {lo if lo < 0 else hi} outside region of {smallest} blocks")
