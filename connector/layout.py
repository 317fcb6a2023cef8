"""Pure block-id -> descriptor arithmetic over a ``KVLayout`` (no NIXL, no torch)."""

from __future__ import annotations

from connector.metadata import KVLayout


def region_descriptors(layout: KVLayout) -> list[tuple[int, int, int]]:
    """Every block of every region as ``(address, length, device id)``, region-major.

    Descriptor ``r * num_blocks + b`` is block ``b`` of region ``r``; both sides prepare their
    lists in this order, so a block pair maps to the same index arithmetic on each side.
    """
    return [
        (region.base + b * region.block_len, region.block_len, layout.device_id)
        for region in layout.regions
        for b in range(region.num_blocks)
    ]


def descriptor_indices(layout: KVLayout, block_ids: tuple[int, ...] | list[int]) -> list[int]:
    """Indices into ``region_descriptors(layout)`` for ``block_ids`` in every region."""
    out: list[int] = []
    offset = 0
    for region in layout.regions:
        for b in block_ids:
            if not 0 <= b < region.num_blocks:
                raise ValueError(f"block id {b} outside region of {region.num_blocks} blocks")
            out.append(offset + b)
        offset += region.num_blocks
    return out


def pair_blocks(local: tuple[int, ...], remote: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Align the tails: decode may already hold a prefix (local cache hit) and register fewer blocks."""
    n = min(len(local), len(remote))
    return tuple(local[len(local) - n :]), tuple(remote[len(remote) - n :])


def block_bytes(layout: KVLayout) -> int:
    """Bytes one block id stands for, across all regions."""
    return sum(r.block_len for r in layout.regions)
