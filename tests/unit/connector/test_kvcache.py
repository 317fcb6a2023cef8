"""KV cache description on the caches vLLM 0.32 itself allocates (``allocate_kv_cache`` on CPU tensors
shaped and strided as on a GPU), for every ``KVCacheLayout``; memory type, parallelism, ports, hash fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from connector.kvcache import (
    REQUESTED_LAYOUT,
    SUPPORTED_LAYOUTS,
    KVCaches,
    KVCacheUnsupported,
    check_parallelism,
    compatibility_fields,
    compatibility_signature,
    describe_kv_caches,
    memory_type,
    side_channel_port,
)
from connector.parallel.ranks import rank_port
from connector.wire.metadata import RankId, compatibility_hash

BLOCKS, LAYERS, HEADS, TOKENS, HEAD_SIZE = 10, 3, 4, 16, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_caches(
    layout: KVCacheLayout,
    *,
    heads: int = HEADS,
    kernel_block_size: int | None = None,
    padded: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What ``register_kv_caches`` receives: vLLM's own allocation (one backing buffer, one view per layer)."""
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=dtype, page_size_padded=padded
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * BLOCKS * LAYERS, layers=NAMES, layer_stride=layer_stride, block_stride=block_stride
    )
    config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)]
    )
    sizes = [kernel_block_size] if kernel_block_size else None
    caches = cast(dict[str, torch.Tensor], allocate_kv_cache(config, torch.device("cpu"), layout, sizes))
    return caches, caches[NAMES[0]]


def page_bytes(heads: int = HEADS) -> int:
    return heads * TOKENS * 2 * HEAD_SIZE * 2  # K and V, bf16


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_layer_compact_layouts_are_one_region_per_layer_in_one_storage(layout: str) -> None:
    caches, first = vllm_caches(KVCacheLayout[layout])
    kv = describe_kv_caches(caches, num_blocks=BLOCKS, kv_buffer_device="cpu", expected_layout=layout)
    page = page_bytes()
    storage = first.untyped_storage()
    assert kv.geometry.layout == layout
    assert (kv.mem_type, kv.device_id) == ("DRAM", 0)
    assert kv.layers == tuple(NAMES)
    assert [(r.base, r.block_len, r.num_blocks) for r in kv.regions] == [
        (first.data_ptr() + i * page * BLOCKS, page, BLOCKS) for i in range(LAYERS)
    ]
    assert [(s.base, s.nbytes) for s in kv.storages] == [(storage.data_ptr(), storage.nbytes())]
    assert kv.region_offsets == tuple((0, i * page * BLOCKS) for i in range(LAYERS))
    assert kv.registrations().tolist() == [[storage.data_ptr(), storage.nbytes(), 0]]
    assert (kv.geometry.num_heads, kv.geometry.states_per_block, kv.geometry.dtype) == (HEADS, TOKENS, "bfloat16")
    assert kv.layout(TOKENS).regions == kv.regions


def test_a_region_is_exactly_the_bytes_of_its_layer_s_block() -> None:
    caches, _ = vllm_caches(KVCacheLayout.LBNHC)
    kv = describe_kv_caches(caches, num_blocks=BLOCKS)
    caches[NAMES[2]][7].fill_(1.0)  # block 7 of layer 2, through vLLM's permuted view
    storage = caches[NAMES[0]].untyped_storage()
    flat = torch.tensor([], dtype=torch.int8).set_(storage)
    nonzero = flat.nonzero().flatten()
    region = kv.regions[2]
    start = region.base - storage.data_ptr() + 7 * region.block_len
    assert int(nonzero.min()) >= start and int(nonzero.max()) < start + region.block_len


def test_the_requested_layout_is_the_one_vllm_calls_layer_and_block_compact() -> None:
    assert REQUESTED_LAYOUT in SUPPORTED_LAYOUTS
    for layout in KVCacheLayout:
        assert (layout.name in SUPPORTED_LAYOUTS) == (layout.is_layer_compact and layout.is_block_compact)


@pytest.mark.parametrize(
    ("layout", "says"),
    [("BLHNC", "block-outer"), ("BLNHC", "block-outer"), ("BHLNC", "head-outer"), ("LHBNC", "head-outer")],
)
def test_other_layouts_are_refused_from_the_tensors_alone(layout: str, says: str) -> None:
    caches, _ = vllm_caches(KVCacheLayout[layout])
    with pytest.raises(KVCacheUnsupported, match=says) as err:
        describe_kv_caches(caches, num_blocks=BLOCKS)
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC" in str(err.value)


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC", "LHBNC"])
def test_a_refused_layout_named_by_vllm_is_refused_by_name(layout: str) -> None:
    caches, _ = vllm_caches(KVCacheLayout[layout])
    with pytest.raises(KVCacheUnsupported, match=f"layout {layout} is (block|head)-outer"):
        describe_kv_caches(caches, num_blocks=BLOCKS, expected_layout=layout)


def test_tensors_that_contradict_vllm_s_layout_name_are_refused() -> None:
    caches, _ = vllm_caches(KVCacheLayout.LBNHC)
    with pytest.raises(KVCacheUnsupported, match="layout is LBHNC but the tensors' strides show LBNHC"):
        describe_kv_caches(caches, num_blocks=BLOCKS, expected_layout="LBHNC")


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_kernel_block_splitting_is_refused_with_the_block_size_to_use(layout: str) -> None:
    caches, first = vllm_caches(KVCacheLayout[layout], kernel_block_size=8)
    assert first.shape[0] == 2 * BLOCKS  # vLLM did split
    with pytest.raises(KVCacheUnsupported, match=r"kernel-block splitting: set --block-size 8"):
        describe_kv_caches(caches, num_blocks=BLOCKS)


def test_a_single_head_page_takes_the_layout_vllm_names() -> None:
    caches, _ = vllm_caches(KVCacheLayout.LBNHC, heads=1)  # H = 1: LBHNC and LBNHC are the same bytes
    assert describe_kv_caches(caches, num_blocks=BLOCKS, expected_layout="LBNHC").geometry.layout == "LBNHC"
    assert describe_kv_caches(caches, num_blocks=BLOCKS).geometry.layout == REQUESTED_LAYOUT


def test_padded_pages_are_moved_whole() -> None:
    padded = page_bytes() + 512
    caches, _ = vllm_caches(KVCacheLayout.LBHNC, padded=padded)
    kv = describe_kv_caches(caches, num_blocks=BLOCKS)
    assert [r.block_len for r in kv.regions] == [padded] * LAYERS
    assert kv.regions[1].base - kv.regions[0].base == padded * BLOCKS


def test_layers_sharing_one_cache_count_once() -> None:
    caches, first = vllm_caches(KVCacheLayout.LBHNC)
    shared = {**caches, "model.layers.3.self_attn.attn": first}
    kv = describe_kv_caches(shared, num_blocks=BLOCKS)
    assert kv.layers == tuple(NAMES) and len(kv.regions) == LAYERS


def test_mixed_page_geometries_are_refused() -> None:
    caches, _ = vllm_caches(KVCacheLayout.LBHNC)
    other, _ = vllm_caches(KVCacheLayout.LBHNC, heads=2)
    with pytest.raises(KVCacheUnsupported, match="mixed KV geometries"):
        describe_kv_caches({**caches, "draft.attn": other[NAMES[0]]}, num_blocks=BLOCKS)


def test_a_raw_cache_without_layer_views_is_refused() -> None:
    caches, first = vllm_caches(KVCacheLayout.LBHNC)
    raw = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())
    with pytest.raises(KVCacheUnsupported, match="Mamba"):
        describe_kv_caches({**caches, "mamba": raw}, num_blocks=BLOCKS)


def test_a_block_count_that_is_not_the_engine_s_is_refused() -> None:
    caches, _ = vllm_caches(KVCacheLayout.LBHNC)
    with pytest.raises(KVCacheUnsupported, match="has 10 blocks, the engine 7"):
        describe_kv_caches(caches, num_blocks=7)


def test_no_caches_is_refused() -> None:
    with pytest.raises(KVCacheUnsupported, match="no KV caches"):
        describe_kv_caches({}, num_blocks=BLOCKS)


# ---- memory type: from the tensors' device --------------------------------------------------


class OnDevice:
    """A CPU tensor that reports another device (the one seam: where vLLM put the cache)."""

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self._tensor, self.device = tensor, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tensor, name)


def on(device: str, caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: cast(torch.Tensor, OnDevice(t, torch.device(device))) for name, t in caches.items()}


@pytest.fixture
def lbhnc() -> Iterator[dict[str, torch.Tensor]]:
    caches, _ = vllm_caches(KVCacheLayout.LBHNC)
    yield caches


@pytest.mark.parametrize("buffer_device", [None, "cuda"])
def test_cuda_tensors_are_vram_on_their_own_device(lbhnc: dict[str, torch.Tensor], buffer_device: str | None) -> None:
    kv = describe_kv_caches(on("cuda:3", lbhnc), num_blocks=BLOCKS, kv_buffer_device=buffer_device)
    assert (kv.mem_type, kv.device_id) == ("VRAM", 3)
    assert kv.registrations()[:, 2].tolist() == [3]
    assert kv.layout(TOKENS).mem_type == "VRAM"


def test_host_staging_on_a_cuda_cache_is_refused(lbhnc: dict[str, torch.Tensor]) -> None:
    with pytest.raises(KVCacheUnsupported, match="host staging"):
        describe_kv_caches(on("cuda:0", lbhnc), num_blocks=BLOCKS, kv_buffer_device="cpu")


def test_a_cuda_buffer_device_over_host_tensors_is_refused(lbhnc: dict[str, torch.Tensor]) -> None:
    with pytest.raises(KVCacheUnsupported, match="lives in host memory"):
        describe_kv_caches(lbhnc, num_blocks=BLOCKS, kv_buffer_device="cuda")


def test_caches_on_several_devices_are_refused(lbhnc: dict[str, torch.Tensor]) -> None:
    mixed = {**lbhnc, **on("cuda:1", {NAMES[0]: lbhnc[NAMES[0]]})}
    with pytest.raises(KVCacheUnsupported, match="several devices"):
        describe_kv_caches(mixed, num_blocks=BLOCKS)


@pytest.mark.parametrize(
    ("device", "buffer", "result"),
    [
        ("cpu", None, ("DRAM", 0)),
        ("cpu", "cpu", ("DRAM", 0)),
        ("cuda:2", "cuda", ("VRAM", 2)),
        ("cuda", None, ("VRAM", 0)),
    ],
)
def test_memory_type_comes_from_the_device(device: str, buffer: str | None, result: tuple[str, int]) -> None:
    assert memory_type(torch.device(device), buffer) == result


def test_other_devices_are_refused() -> None:
    with pytest.raises(KVCacheUnsupported, match="'xpu'"):
        memory_type(torch.device("xpu", 0))


# ---- parallelism and ports -------------------------------------------------------------------


def test_one_rank_everywhere_and_tensor_parallelism_are_accepted() -> None:
    check_parallelism(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1)
    for tp in (2, 4, 8):
        check_parallelism(tensor_parallel_size=tp)
    check_parallelism(tensor_parallel_size=2, pipeline_parallel_size=2, kv_role="kv_producer")  # PP on prefill


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 4, "kv_role": "kv_consumer"},
            "only on a prefill.*a decode must run pipeline_parallel_size=1",
        ),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "kv_role": "kv_both"}, "only on a prefill"),
        ({"tensor_parallel_size": 1, "decode_context_parallel_size": 2}, "decode_context_parallel_size=1 only"),
    ],
)
def test_sharded_engines_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(KVCacheUnsupported, match=says):
        check_parallelism(**kwargs)


def test_each_data_parallel_rank_gets_its_own_side_channel_port() -> None:
    assert [side_channel_port(5600, rank) for rank in range(4)] == [5600, 5601, 5602, 5603]


def test_every_rank_of_every_dp_engine_gets_its_own_port() -> None:
    """Rank (0, tp) of DP engine i: base + i * world + tp; with TP = 1 that is base + i (as before)."""
    ports = [rank_port(side_channel_port(5600, dp, 2), RankId(0, tp), 2) for dp in range(3) for tp in range(2)]
    assert ports == [5600, 5601, 5602, 5603, 5604, 5605]
    pp_tp = [rank_port(side_channel_port(5600, 1, 4), RankId(pp, tp), 2) for pp in range(2) for tp in range(2)]
    assert pp_tp == [5604, 5605, 5606, 5607]
    with pytest.raises(ValueError, match="not TCP ports"):
        side_channel_port(65534, 0, 4)


@pytest.mark.parametrize(("base", "rank"), [(5600, -1), (65535, 1), (0, 0)])
def test_impossible_ports_are_refused(base: int, rank: int) -> None:
    with pytest.raises(ValueError, match=r"rank|TCP port"):
        side_channel_port(base, rank)


# ---- compatibility hash ------------------------------------------------------------------------


def fields_of(kv: KVCaches, **over: Any) -> dict[str, str]:
    args: dict[str, Any] = {
        "model": "Qwen/Qwen3-0.6B",
        "model_dtype": "torch.bfloat16",
        "cache_dtype": "auto",
        "attn_backend": "FLASH_ATTN",
        "num_kv_heads": HEADS,
        "head_size": HEAD_SIZE,
        "block_size": TOKENS,
        "vllm_version": "0.32.0",
    }
    return compatibility_fields(kv, **(args | over))


def test_the_fields_cover_layout_backend_geometry_dtypes_and_version(lbhnc: dict[str, torch.Tensor]) -> None:
    fields = fields_of(describe_kv_caches(lbhnc, num_blocks=BLOCKS))
    assert fields["kv_layout"] == "LBHNC"
    assert fields["attn_backend"] == "FLASH_ATTN"
    assert (fields["num_kv_heads"], fields["head_size"]) == ("4", "8")
    assert "head_slots" not in fields and "page_bytes" not in fields  # per rank: ranks of unequal TP pair
    assert (fields["block_size"], fields["kernel_block_size"]) == ("16", "16")
    assert (fields["kv_dtype"], fields["model_dtype"], fields["cache_dtype"]) == ("bfloat16", "bfloat16", "auto")
    assert fields["vllm_version"] == "0.32.0"


def test_layouts_of_equal_size_hash_differently() -> None:
    a = describe_kv_caches(vllm_caches(KVCacheLayout.LBHNC)[0], num_blocks=BLOCKS)
    b = describe_kv_caches(vllm_caches(KVCacheLayout.LBNHC)[0], num_blocks=BLOCKS)
    assert a.layout(TOKENS).shape_signature() == b.layout(TOKENS).shape_signature()  # bytes alone agree
    hash_a = compatibility_hash(compatibility_signature(fields_of(a)), a.layout(TOKENS))
    hash_b = compatibility_hash(compatibility_signature(fields_of(b)), b.layout(TOKENS))
    assert hash_a != hash_b


@pytest.mark.parametrize(
    "change",
    [{"attn_backend": "FLASHINFER"}, {"vllm_version": "0.33.0"}, {"cache_dtype": "fp8"}, {"head_size": 16}],
)
def test_any_field_changes_the_signature(lbhnc: dict[str, torch.Tensor], change: dict[str, Any]) -> None:
    kv = describe_kv_caches(lbhnc, num_blocks=BLOCKS)
    assert compatibility_signature(fields_of(kv)) != compatibility_signature(fields_of(kv, **change))


def test_the_signature_does_not_depend_on_field_order(lbhnc: dict[str, torch.Tensor]) -> None:
    fields = fields_of(describe_kv_caches(lbhnc, num_blocks=BLOCKS))
    assert compatibility_signature(fields) == compatibility_signature(dict(reversed(list(fields.items()))))
