"""The GPU check's pure parts: arguments, the vLLM-shaped caches it builds, its rounds, its summary, its VMM
variants and where a failed check stopped. The check itself (two processes, NIXL) runs in
tests/integration/loadtest/micro/test_gpu_check_cpu.py; the VMM mode needs a GPU and is not run here."""

from __future__ import annotations

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

from connector.kvcache import describe_kv_caches
from loadtest.micro.gpu_check.caches import vllm_like_caches
from loadtest.micro.gpu_check.check import VERDICTS, parse_args, summary, vmm_summary, vmm_variants
from loadtest.micro.gpu_check.config import CheckConfig, plan_rounds
from loadtest.micro.gpu_check.peer import failed_stage


def test_gpu_defaults_are_a_16k_prompt_over_a_32_layer_cache() -> None:
    cfg, json_path = parse_args([])
    assert (cfg.device, cfg.layers, cfg.blocks, cfg.write_blocks, cfg.tokens) == ("cuda", 32, 4096, 1024, 16)
    assert cfg.backends == ("UCX",) and json_path is None
    assert cfg.deadline_s < 300


def test_cpu_gets_small_defaults_and_explicit_sizes_win() -> None:
    cfg, json_path = parse_args(["--device", "cpu", "--blocks", "128", "--json", "out.json", "--backends", "UCX,POSIX"])
    assert (cfg.device, cfg.layers, cfg.blocks, cfg.write_blocks) == ("cpu", 4, 128, 16)
    assert cfg.backends == ("UCX", "POSIX") and json_path == "out.json"
    assert cfg.decode_device == "cpu"
    assert parse_args(["--d-device", "cuda:1"])[0].decode_device == "cuda:1"


def test_tp_ranks_are_parsed_and_a_split_the_heads_do_not_allow_is_refused() -> None:
    cfg, _ = parse_args(["--device", "cpu", "--p-tp", "2", "--d-tp", "4"])
    assert (cfg.p_tp, cfg.d_tp, cfg.heads) == (2, 4, 2)
    assert parse_args([])[0].p_tp == parse_args([])[0].d_tp == 1
    for bad in (["--p-tp", "0"], ["--p-tp", "3"], ["--d-tp", "2", "--layout", "LBNHC"]):
        with pytest.raises(SystemExit):  # 3 ranks over 8 heads; heads are byte ranges of a block only in LBHNC
            parse_args(bad)


def test_a_bulk_round_larger_than_half_the_cache_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--blocks", "20", "--write-blocks", "11"])


SMALL = CheckConfig(device="cpu", layers=3, blocks=10, heads=4, tokens=16, head_size=8, write_blocks=3)


def vllm_allocation(layout: KVCacheLayout, cfg: CheckConfig) -> dict[str, torch.Tensor]:
    spec = FullAttentionSpec(
        block_size=cfg.tokens, num_kv_heads=cfg.heads, head_size=cfg.head_size, dtype=getattr(torch, cfg.dtype)
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.layers)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, cfg.blocks, cfg.layers, layout)
    size = spec.page_size_bytes * cfg.blocks * cfg.layers
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    groups = [KVCacheGroupSpec(names, spec)]
    config = KVCacheConfig(num_blocks=cfg.blocks, kv_cache_tensors=[tensor], kv_cache_groups=groups)
    return cast(dict[str, torch.Tensor], allocate_kv_cache(config, torch.device("cpu"), layout))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_the_check_s_caches_are_shaped_and_strided_as_vllm_allocates_them(layout: str) -> None:
    cfg = CheckConfig(**{**SMALL.__dict__, "layout": layout})
    ours, raw = vllm_like_caches(cfg, "cpu")
    theirs = vllm_allocation(KVCacheLayout[layout], cfg)
    assert list(ours) == list(theirs)
    for name, t in theirs.items():
        o = ours[name]
        assert (o.shape, o.stride(), o.dtype) == (t.shape, t.stride(), t.dtype)
        base, their_base = raw.data_ptr(), t.untyped_storage().data_ptr()
        assert o.data_ptr() - base == t.data_ptr() - their_base
    assert raw.untyped_storage().nbytes() == next(iter(theirs.values())).untyped_storage().nbytes()
    assert describe_kv_caches(ours, num_blocks=cfg.blocks, expected_layout=layout).geometry.layout == layout


def test_rounds_write_fresh_decode_blocks_each_time() -> None:
    cfg = CheckConfig(device="cpu", blocks=64, write_blocks=16)
    rounds = plan_rounds(cfg)
    assert [name for name, _, _ in rounds] == ["bulk", "scattered", "prefix-hit"]
    bulk = rounds[0]
    assert bulk[1] == tuple(range(16)) and bulk[2] == tuple(range(48, 64))
    d_blocks = [b for _, _, dst in rounds for b in dst]
    assert len(d_blocks) == len(set(d_blocks)) and all(0 <= b < 64 for b in d_blocks)
    assert all(0 <= b < 64 for _, src, _ in rounds for b in src)
    _, src, dst = rounds[2]
    assert len(dst) < len(src)  # D holds a prefix: only the tail is written
    assert plan_rounds(cfg) == rounds  # seeded


def result_of(ok: bool, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"ok": ok, "wall_s": 1.5, "environment": {"python": "3.12.3"}, "failures": []}
    return base | extra


def test_summary_says_pass_and_gives_the_figures() -> None:
    row = {
        "name": "bulk",
        "blocks": 2,
        "bytes": 2**21,
        "descriptors": 64,
        "write_s": [0.002, 0.001],
        "gbps_best": 2.1,
        "gbps_median": 1.4,
        "verified": 2,
    }
    text = summary(result_of(True, rounds=[row], untouched_nonzero_bytes=0))
    assert text.startswith("kvpush GPU check: PASS in 1.5 s")
    assert "bulk: 2 blocks, 2.0 MiB, 64 descriptors, WRITE best 1.00 ms (2.1 GB/s" in text
    assert "SHA-256 verified 2/2" in text


def test_summary_says_fail_and_why() -> None:
    text = summary(result_of(False, rounds=[{"name": "bulk", "state": "ERR"}], failures=["round bulk: WRITE ERR"]))
    assert text.startswith("kvpush GPU check: FAIL")
    assert "bulk: WRITE ERR" in text and "FAILURE: round bulk: WRITE ERR" in text


def test_vmm_is_asked_by_flag_and_needs_cuda_on_both_sides() -> None:
    cfg, _ = parse_args(["--alloc", "vmm", "--vmm-chunks", "4", "--vmm-storages", "layer", "--vmm-rdma", "off"])
    assert (cfg.alloc, cfg.vmm_chunks, cfg.vmm_storages, cfg.vmm_rdma) == ("vmm", 4, "layer", "off")
    plain, _ = parse_args([])
    assert (plain.alloc, plain.vmm_storages, plain.vmm_rdma) == ("cudamalloc", "whole", "auto")
    for bad in (["--device", "cpu"], ["--d-device", "cpu"], ["--vmm-chunks", "0"], ["--vmm-rdma", "maybe"]):
        with pytest.raises(SystemExit):
            parse_args(["--alloc", "vmm", *bad])


def test_vmm_runs_one_chunk_then_several_and_once_when_they_are_the_same() -> None:
    cfg = CheckConfig(alloc="vmm", vmm_chunks=8)
    assert [v.vmm_chunks for v in vmm_variants(cfg)] == [1, 8]
    assert [v.vmm_chunks for v in vmm_variants(CheckConfig(alloc="vmm", vmm_chunks=1))] == [1]
    assert all(v.alloc == "vmm" for v in vmm_variants(cfg))


def test_a_failed_check_names_where_it_stopped() -> None:
    assert failed_stage(result_of(True)) is None
    registering = "P failed:\n[stage register] Traceback (most recent call last): nixlBackendError"
    assert failed_stage(result_of(False, failures=[registering])) == "register"
    assert failed_stage(result_of(False, failures=["x"], rounds=[{"name": "bulk", "state": "ERR"}])) == "write"
    assert failed_stage(result_of(False, failures=["1 of 2 blocks differ"], rounds=[{"state": "DONE"}])) == "verify"
    assert set(VERDICTS) >= {None, "start", "alloc", "describe", "register", "ready", "write", "verify"}


def vmm_peer(spanning: int) -> dict[str, Any]:
    return {
        "mem_type": "VRAM",
        "device": "cuda:0",
        "device_name": "H100",
        "layout": "LBHNC",
        "regions": 32,
        "storages": 1,
        "registrations": 1,
        "descriptors": 131072,
        "timings": {"alloc_s": 0.5, "backend_s": 0.01},
        "alloc": "vmm",
        "registrations_spanning_chunks": spanning,
    }


def test_the_vmm_summary_gives_each_variant_its_verdict() -> None:
    one = result_of(True, config={"vmm_chunks": 1}, peers={"P": vmm_peer(0), "D": vmm_peer(0)}, rounds=[])
    several = result_of(False, config={"vmm_chunks": 8}, failures=["D failed:\n[stage register] Traceback ..."])
    run = {"ok": False, "wall_s": 9.0, "config": {"vmm_storages": "whole", "vmm_rdma": "auto"}}
    text = vmm_summary({**run, "variants": [one, several]})
    assert text.startswith("kvpush GPU check, VMM (whole storages, RDMA flag auto): FAIL in 9.0 s")
    assert "  1 physical chunk(s): registered, every WRITE done and every block verified, registrations across" in text
    assert "  8 physical chunk(s): NIXL registration failed\n" in text
    assert text.count("kvpush GPU check: ") == 2  # each variant's own summary follows
    spanning = result_of(True, config={"vmm_chunks": 8}, peers={"P": vmm_peer(1)}, rounds=[])
    assert "8 physical chunk(s): registered, every WRITE done and every block verified, registrations across " in (
        vmm_summary({**run, "variants": [spanning]})
    )
