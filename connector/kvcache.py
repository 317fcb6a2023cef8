"""What the KV caches handed to ``register_kv_caches`` look like, and what kvpush accepts of them.

vLLM 0.32 allocates one flat ``int8`` backing buffer per device and hands the connector one 4-D view
per layer over it: logical shape ``[B, H, N, C]`` (blocks, head slots, kernel states = tokens per
kernel block, content elements; K and V packed in C), strides set by the resolved
``KVCacheLayout`` (a permutation of ``[L, B, H, N, C]``). This module reads only the tensors'
shapes, strides, storages and devices (duck-typed; no vLLM, no NIXL) and answers:

* which layout it is (``describe_kv_caches``): kvpush moves whole blocks, so it needs every layer's
  block to be one contiguous run and every layer's blocks to be back to back (layer-compact,
  block-compact): ``LBHNC`` (requested, ``REQUESTED_LAYOUT``) or ``LBNHC`` (vLLM's default for
  FlashAttention/Triton when nobody asks; accepted: the block interior's order does not matter for a
  block-for-block copy as long as both sides agree, which the compatibility hash enforces).
  Refused with a message that says why: block-outer layouts (``BLHNC``, ``BLNHC``, ``BHLNC``),
  head-outer ones (``LHBNC``), kernel-block splitting, raw (non-view) caches, mixed geometries;
* which NIXL memory type and device (``memory_type``): from ``tensor.device``, never from
  ``kv_buffer_device`` alone; host staging (``kv_buffer_device: cpu`` over CUDA tensors) is refused;
* what to register (``KVCaches.registrations``): each backing storage once, the per-layer regions
  being offsets into it (``KVCaches.region_offsets``);
* what the compatibility hash must cover (``compatibility_fields``, ``compatibility_signature``);
* the parallelism it supports (``check_parallelism``: TP = PP = DCP = 1) and the side-channel port
  of a data-parallel rank (``side_channel_port``).

Errors are ``KVCacheUnsupported`` (a ``ValueError``), raised at registration so a misconfigured
engine fails at startup with the reason, never by garbling KV later.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from connector.wire.metadata import KVLayout, Region

if TYPE_CHECKING:
    import torch

REQUESTED_LAYOUT: Final = "LBHNC"
"""What ``KvpushConnector.get_required_kvcache_layout`` returns (as upstream NIXL does). vLLM uses it
when every attention backend supports it (FlashAttention and Triton declare no preference; the CPU
backend supports only LBHNC) and otherwise warns and picks its own, which ``describe_kv_caches``
then accepts or refuses."""

SUPPORTED_LAYOUTS: Final = ("LBHNC", "LBNHC")
"""Layer-compact, block-compact layouts: each layer's block is one contiguous page."""

_REFUSED_LAYOUTS: Final = {
    "BLHNC": "block-outer (each block interleaves the pages of every layer)",
    "BLNHC": "block-outer (each block interleaves the pages of every layer)",
    "BHLNC": "block-outer (each block interleaves the pages of every layer)",
    "LHBNC": "head-outer (a block's heads lie in separate planes, so a block is not one contiguous run)",
}

_FIX = f"set VLLM_KV_CACHE_LAYOUT={REQUESTED_LAYOUT} or use an attention backend that supports it"


class KVCacheUnsupported(ValueError):
    """The KV cache (layout, device, parallelism) is one kvpush cannot transfer; the text says why."""


# --------------------------------------------------------------------------------------------
# Parallelism and ports
# --------------------------------------------------------------------------------------------


def check_parallelism(
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    kv_role: str = "kv_producer",
) -> None:
    """Refuse what kvpush cannot transfer (call from the connector's ``__init__``, both roles).

    Tensor parallelism is served rank by rank (``connector.parallel.ranks``: P_tp = D_tp, P_tp > D_tp, and P_tp < D_tp
    through the prefill-side fan-out, ``connector.parallel.fanout``). Pipeline parallelism on a prefill
    (``kv_producer``): each stage writes its own layers (``ranks.stage_window``); a decode needs PP 1.
    Data parallelism is fine: each DP rank is its own engine with its own ports
    (``side_channel_port``)."""
    if tensor_parallel_size < 1:
        raise KVCacheUnsupported(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if pipeline_parallel_size < 1:
        raise KVCacheUnsupported(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
    if pipeline_parallel_size != 1 and kv_role != "kv_producer":
        raise KVCacheUnsupported(
            f"kvpush pushes from pipeline stages only on a prefill (kv_role kv_producer); this {kv_role} runs "
            f"pipeline_parallel_size={pipeline_parallel_size}: a decode must run pipeline_parallel_size=1"
        )
    if decode_context_parallel_size != 1:
        raise KVCacheUnsupported(
            f"kvpush supports decode_context_parallel_size=1 only (got {decode_context_parallel_size}): "
            "DCP shards token positions across ranks"
        )


def side_channel_port(base_port: int, dp_rank: int, world_size: int = 1) -> int:
    """The side-channel port of rank (0, 0) of data-parallel engine ``dp_rank``: ``base_port + dp_rank *
    world_size`` with ``world_size = tensor_parallel_size * pipeline_parallel_size``. Rank ``(pp, tp)`` of the
    engine listens on that port ``+ pp * tensor_parallel_size + tp`` (``connector.parallel.ranks.rank_port``), so the
    ports of an engine's ranks are consecutive and DP engines on one host do not collide. With TP = PP = 1 this
    is ``base_port + dp_rank``, as upstream. A router or launcher naming the port of a DP engine with TP > 1
    must use the same rule (the prefill's own answer states its rank-0 port).

    Pass vLLM's ``parallel_config.data_parallel_index``, not ``data_parallel_rank``: vLLM 0.32 runs
    the DP ranks of a dense (non-MoE) model as independent engines and resets their
    ``data_parallel_rank`` to 0 (``reconfigure_for_independent_dp_rank``); only the index keeps
    the rank."""
    if dp_rank < 0 or world_size < 1:
        raise ValueError(f"data-parallel rank must be >= 0 and world size >= 1, got {dp_rank} and {world_size}")
    port = base_port + dp_rank * world_size
    last = port + world_size - 1
    if not (port > 0 and last < 65536):
        raise ValueError(
            f"side-channel ports {port}..{last} (base {base_port} + DP rank {dp_rank} x world {world_size}) "
            "are not TCP ports"
        )
    return port


# --------------------------------------------------------------------------------------------
# Memory type
# --------------------------------------------------------------------------------------------


def memory_type(device: torch.device, kv_buffer_device: str | None = None) -> tuple[str, int]:
    """NIXL ``(memory type, device id)`` of tensors on ``device``: ``("VRAM", index)`` for CUDA,
    ``("DRAM", 0)`` for host memory.

    ``kv_buffer_device`` (vLLM's ``kv_transfer_config.kv_buffer_device``, whose default is the
    platform's device type) must agree with where the tensors are: ``"cpu"`` over CUDA tensors means
    host staging upstream (blocks copied to a pinned host buffer and moved from there), which kvpush
    does not implement; it is refused rather than registering device pointers as DRAM.
    """
    kind = device.type
    if kind == "cuda":
        if kv_buffer_device not in (None, "cuda"):
            raise KVCacheUnsupported(
                f"kv_buffer_device={kv_buffer_device!r} on a CUDA KV cache means host staging (copy blocks to a "
                "host buffer, transfer from there), which kvpush does not do: it registers GPU memory and "
                'WRITEs it directly. Set "kv_buffer_device": "cuda" (or leave it out)'
            )
        return "VRAM", 0 if device.index is None else int(device.index)
    if kind == "cpu":
        if kv_buffer_device not in (None, "cpu"):
            raise KVCacheUnsupported(
                f"kv_buffer_device={kv_buffer_device!r} but the KV cache lives in host memory (cpu tensors): "
                'set "kv_buffer_device": "cpu" (or leave it out)'
            )
        return "DRAM", 0
    raise KVCacheUnsupported(f"KV cache on {kind!r}: kvpush registers host (cpu) or CUDA memory only")


# --------------------------------------------------------------------------------------------
# Layout detection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageGeometry:
    """One layer's page, as the tensors show it (equal for every layer, and on P and D)."""

    layout: str  # "LBHNC" or "LBNHC"
    num_heads: int  # H: head slots (= num KV heads for plain attention)
    states_per_block: int  # N: kernel states per block (= kernel block size in tokens for attention)
    content: int  # C: elements per (head, state), K and V together
    dtype: str  # the views' dtype, e.g. "bfloat16"
    element_size: int
    block_len: int  # bytes between consecutive blocks of a layer (the page, padding included)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's block without padding (H * N * C elements)."""
        return self.num_heads * self.states_per_block * self.content * self.element_size


@dataclass(frozen=True)
class Storage:
    """One backing allocation: registered once with NIXL."""

    base: int
    nbytes: int


@dataclass(frozen=True)
class KVCaches:
    """The registered KV caches: what ``describe_kv_caches`` found."""

    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    num_blocks: int
    geometry: PageGeometry
    layers: tuple[str, ...]  # one per region, in region order (aliases of an earlier layer left out)
    regions: tuple[Region, ...]  # absolute addresses (what the handshake sends)
    storages: tuple[Storage, ...]
    region_offsets: tuple[tuple[int, int], ...]  # per region: (storage index, byte offset into it)

    def layout(self, block_size: int) -> KVLayout:
        """The wire ``KVLayout`` (``block_size`` = vLLM's manager block size in tokens)."""
        return KVLayout(self.mem_type, self.device_id, block_size, self.regions)

    def registrations(self) -> npt.NDArray[np.uint64]:
        """``(K, 3)`` rows ``(address, length, device id)``, one per backing storage, for NIXL's
        ``register_memory(rows, mem_type)`` (instead of one registration per layer)."""
        out = np.empty((len(self.storages), 3), dtype=np.uint64)
        for i, s in enumerate(self.storages):
            out[i] = (s.base, s.nbytes, self.device_id)
        return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _interior_layout(name: str, shape: tuple[int, ...], strides: tuple[int, ...], expected: str | None) -> str:
    """``LBHNC`` or ``LBNHC`` from one view's H/N/C strides (in elements), or refuse."""
    _, h, n, c = shape
    _, sh, sn, sc = strides
    if c > 1 and sc != 1:
        raise KVCacheUnsupported(f"KV cache {name}: content dim is not innermost (strides {strides})")
    hnc = (h <= 1 or sh == n * c) and (n <= 1 or sn == c)
    nhc = (n <= 1 or sn == h * c) and (h <= 1 or sh == c)
    if hnc and nhc:  # H or N is 1: both orders are the same bytes
        return expected if expected in SUPPORTED_LAYOUTS else REQUESTED_LAYOUT
    if hnc:
        return "LBHNC"
    if nhc:
        return "LBNHC"
    raise KVCacheUnsupported(
        f"KV cache {name}: a block's bytes are not one contiguous run (shape {shape}, strides {strides}): a "
        f"head-outer layout (LHBNC/BHLNC-like); kvpush transfers {', '.join(SUPPORTED_LAYOUTS)} only: {_FIX}"
    )


def _check_expected(expected: str | None) -> None:
    if expected is None or expected in SUPPORTED_LAYOUTS:
        return
    why = _REFUSED_LAYOUTS.get(expected, "not a layout kvpush knows")
    raise KVCacheUnsupported(
        f"KV cache layout {expected} is {why}; kvpush transfers layer-compact, block-compact layouts only "
        f"({', '.join(SUPPORTED_LAYOUTS)}): {_FIX}"
    )


def _geometry(name: str, t: torch.Tensor, num_blocks: int, expected: str | None) -> PageGeometry:
    shape = tuple(int(d) for d in t.shape)
    strides = tuple(int(s) for s in t.stride())
    if len(shape) != 4:
        raise KVCacheUnsupported(
            f"KV cache {name} has shape {shape}: kvpush expects vLLM's per-layer [blocks, heads, tokens, content] "
            "views (raw caches such as Mamba state or HiSparse pools are not supported)"
        )
    if shape[0] != num_blocks:
        if num_blocks > 0 and shape[0] % num_blocks == 0:
            ratio = shape[0] // num_blocks
            raise KVCacheUnsupported(
                f"KV cache {name}: vLLM split each block into {ratio} kernel blocks of {shape[2]} tokens "
                f"({shape[0]} kernel blocks for {num_blocks} blocks); kvpush does not support kernel-block "
                f"splitting: set --block-size {shape[2]} (a size the attention backend supports)"
            )
        raise KVCacheUnsupported(f"KV cache {name} has {shape[0]} blocks, the engine {num_blocks}")
    layout = _interior_layout(name, shape, strides, expected)
    elt = int(t.element_size())
    page = shape[1] * shape[2] * shape[3] * elt
    block_len = strides[0] * elt
    if block_len < page:
        raise KVCacheUnsupported(f"KV cache {name}: blocks overlap (block stride {block_len} B < page {page} B)")
    return PageGeometry(layout, shape[1], shape[2], shape[3], _dtype_name(t.dtype), elt, block_len)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_blocks: int,
    kv_buffer_device: str | None = None,
    expected_layout: str | None = None,
) -> KVCaches:
    """Describe (or refuse) the per-layer caches vLLM hands ``register_kv_caches``.

    ``num_blocks``: ``kv_cache_config.num_blocks``; ``kv_buffer_device``: the transfer config's;
    ``expected_layout``: vLLM's resolved layout name (``vllm_config.cache_config.kv_cache_layout``),
    checked against what the strides show. Layers whose view starts where an earlier one's does (KV
    sharing) count once; regions are per layer in the mapping's order (the same on P and D).
    """
    if not kv_caches:
        raise KVCacheUnsupported("no KV caches to register (attention-free model?)")
    _check_expected(expected_layout)
    devices = {(str(t.device.type), t.device.index) for t in kv_caches.values()}
    if len(devices) != 1:
        raise KVCacheUnsupported(f"KV caches on several devices {sorted(map(str, devices))}: one device per worker")
    mem_type, device_id = memory_type(next(iter(kv_caches.values())).device, kv_buffer_device)

    geometry: PageGeometry | None = None
    layers: list[str] = []
    regions: list[Region] = []
    storages: dict[int, Storage] = {}
    spans: list[tuple[int, int, str, int]] = []  # (start, end, layer, storage base)
    for name, t in kv_caches.items():
        g = _geometry(name, t, num_blocks, expected_layout)
        if geometry is None:
            geometry = g
        elif g != geometry:
            raise KVCacheUnsupported(
                f"KV cache {name} has another page geometry ({g}) than {layers[0]} ({geometry}): models with "
                "mixed KV geometries (hybrid allocator) are not supported"
            )
        base = int(t.data_ptr())
        if any(base == start for start, _, _, _ in spans):
            continue  # an alias of a layer already described (KV sharing)
        storage = t.untyped_storage()
        sbase = int(storage.data_ptr())
        storages.setdefault(sbase, Storage(sbase, int(storage.nbytes())))
        spans.append((base, base + g.block_len * (num_blocks - 1) + g.page_bytes, name, sbase))
        layers.append(name)
        regions.append(Region(base, g.block_len, num_blocks))
    assert geometry is not None
    _refuse_interleaved(spans, geometry)
    for (base, _, name, sbase), region in zip(spans, regions, strict=True):
        if not (sbase <= base and base + region.block_len * num_blocks <= sbase + storages[sbase].nbytes):
            raise KVCacheUnsupported(f"KV cache {name} reaches outside its storage")
    if expected_layout in SUPPORTED_LAYOUTS and geometry.layout != expected_layout:
        raise KVCacheUnsupported(
            f"vLLM says the KV cache layout is {expected_layout} but the tensors' strides show {geometry.layout}"
        )
    index = {b: i for i, b in enumerate(storages)}
    return KVCaches(
        mem_type=mem_type,
        device_id=device_id,
        num_blocks=num_blocks,
        geometry=geometry,
        layers=tuple(layers),
        regions=tuple(regions),
        storages=tuple(storages.values()),
        region_offsets=tuple((index[sbase], start - sbase) for start, _, _, sbase in spans),
    )


def _refuse_interleaved(spans: list[tuple[int, int, str, int]], geometry: PageGeometry) -> None:
    ordered = sorted(spans)
    for (_, end, first, _), (start, _, second, _) in itertools.pairwise(ordered):
        if start < end:
            raise KVCacheUnsupported(
                f"KV caches {first} and {second} interleave: a block-outer layout (BLHNC/BLNHC/BHLNC-like, "
                f"block stride {geometry.block_len} B) puts other layers' pages between a layer's blocks; "
                f"kvpush transfers layer-compact layouts only ({', '.join(SUPPORTED_LAYOUTS)}): {_FIX}"
            )


# --------------------------------------------------------------------------------------------
# Compatibility hash
# --------------------------------------------------------------------------------------------


def compatibility_fields(
    caches: KVCaches,
    *,
    model: str,
    model_dtype: str,
    cache_dtype: str,
    attn_backend: str,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    vllm_version: str,
) -> dict[str, str]:
    """Everything P and D must share before a block id is trusted, as canonical strings.

    From the config: model, model dtype, ``cache_dtype`` (e.g. ``auto``, ``fp8``), attention backend
    name, KV heads and head size, manager block size, vLLM version. From the tensors: layout, kernel
    block size (states per block), content width, element dtype and bytes per head per block (the same on
    every rank: ranks of unequal TP pair; ``connector.parallel.ranks.prefill_slices`` checks each pair's geometry). Two
    engines that differ in any of these would read each other's blocks as garbage even where the byte
    counts agree (e.g. LBHNC vs LBNHC pages of equal size).
    """
    g = caches.geometry
    return {
        "model": model,
        "model_dtype": _dtype_name(model_dtype),
        "cache_dtype": str(cache_dtype),
        "kv_dtype": g.dtype,
        "attn_backend": attn_backend,
        "kv_layout": g.layout,
        "num_kv_heads": str(num_kv_heads),
        "head_size": str(head_size),
        "block_size": str(block_size),
        "kernel_block_size": str(g.states_per_block),
        "page_content": str(g.content),
        "head_page_bytes": str(g.block_len // max(1, g.num_heads)),  # equal on every rank, whatever the TP
        "vllm_version": vllm_version,
    }


def compatibility_signature(fields: Mapping[str, str]) -> str:
    """Canonical text of ``fields`` (sorted keys, JSON-escaped values): pass it as ``model_signature``
    to ``connector.wire.metadata.compatibility_hash``."""
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
