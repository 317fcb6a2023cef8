"""The VMM allocation's pure parts (loadtest/micro/gpu_check/vmm.py) over a fake driver, and the VMM-backed caches
over host memory: chunk sizes, the driver calls in order and their undoing, registrations that span chunks, and
one NIXL registration (whole) or one per layer (layer). The CUDA driver itself needs a GPU: not run here."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from connector.kvcache import describe_kv_caches
from loadtest.micro.gpu_check import vmm
from loadtest.micro.gpu_check.caches import cache_bytes, vmm_caches
from loadtest.micro.gpu_check.config import CheckConfig


class FakeDriver:
    """Records every call; `reserve` hands out host memory so the range can be viewed; fails where told."""

    def __init__(self, granularity: int = 4096, rdma: bool = True, fail: str = "") -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.gran, self.rdma, self.fail = granularity, rdma, fail
        self.memory: list[Any] = []
        self.next_handle = 100

    def _record(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] == self.fail:
            raise vmm.VmmError(f"{call[0]} failed: CUresult 2 (CUDA_ERROR_OUT_OF_MEMORY)")

    def rdma_supported(self, device: int) -> bool:
        return self.rdma

    def granularity(self, device: int, rdma: bool) -> int:
        self._record("granularity", device, rdma)
        return self.gran

    def reserve(self, size: int) -> int:
        self._record("reserve", size)
        block = (ctypes.c_int8 * size)()
        self.memory.append(block)
        return ctypes.addressof(block)

    def create(self, size: int, device: int, rdma: bool) -> int:
        self._record("create", size, device, rdma)
        self.next_handle += 1
        return self.next_handle

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._record("map", ptr, size, handle)

    def set_access(self, ptr: int, size: int, device: int) -> None:
        self._record("set_access", ptr, size, device)

    def unmap(self, ptr: int, size: int) -> None:
        self._record("unmap", ptr, size)

    def release(self, handle: int) -> None:
        self._record("release", handle)

    def free(self, ptr: int, size: int) -> None:
        self._record("free", ptr, size)

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


def host_view(ptr: int, nbytes: int) -> torch.Tensor:
    """An int8 tensor over host memory at `ptr` with a storage of its own (as `vmm.as_tensor` gives on a GPU)."""
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_int8 * nbytes).from_address(ptr)))


def test_chunks_split_the_bytes_evenly_rounded_up_to_the_granularity() -> None:
    assert vmm.plan_chunks(8 * 2**20, 1, 2**21) == 8 * 2**20
    assert vmm.plan_chunks(8 * 2**20, 8, 2**21) == 2**21  # 1 MiB each, rounded up to 2 MiB
    assert vmm.plan_chunks(10, 3, 4) == 4
    with pytest.raises(ValueError):
        vmm.plan_chunks(0, 1, 4)


def test_a_registration_that_crosses_a_chunk_boundary_is_counted() -> None:
    base, chunk = 1000, 100
    assert vmm.spanning([(1000, 100), (1100, 100)], base, chunk) == 0  # each inside one chunk
    assert vmm.spanning([(1000, 400)], base, chunk) == 1  # the whole range over four chunks
    assert vmm.spanning([(1050, 100), (1150, 10)], base, chunk) == 1


def test_the_allocation_reserves_creates_maps_then_grants_access_and_close_undoes_it() -> None:
    driver = FakeDriver(granularity=1024)
    buffer = vmm.VmmBuffer.allocate(driver, 0, 3000, 3, "auto")
    assert (buffer.chunk_bytes, buffer.nbytes, buffer.rdma) == (1024, 3072, True)
    names = [c[0] for c in driver.calls]
    assert names == ["granularity", "reserve", "create", "create", "create", "map", "map", "map", "set_access"]
    assert [c[1] - buffer.ptr for c in driver.named("map")] == [0, 1024, 2048]
    assert [c[3] for c in driver.named("map")] == [c for c in range(101, 104)]
    assert driver.named("set_access") == [("set_access", buffer.ptr, 3072, 0)]
    ptr = buffer.ptr
    buffer.close()
    assert len(driver.named("unmap")) == 3 and len(driver.named("release")) == 3
    assert driver.named("free") == [("free", ptr, 3072)]
    buffer.close()  # once
    assert len(driver.named("free")) == 1


@pytest.mark.parametrize(
    ("rdma", "supported", "flag"), [("auto", False, False), ("on", False, True), ("off", True, False)]
)
def test_the_rdma_flag_follows_the_device_unless_told(rdma: str, supported: bool, flag: bool) -> None:
    driver = FakeDriver(rdma=supported)
    buffer = vmm.VmmBuffer.allocate(driver, 1, 4096, 1, rdma)
    assert buffer.rdma is flag and driver.named("create") == [("create", 4096, 1, flag)]
    with pytest.raises(ValueError):
        vmm.VmmBuffer.allocate(driver, 1, 4096, 1, "maybe")


def test_a_failed_map_undoes_what_was_done_and_raises() -> None:
    driver = FakeDriver(fail="map")
    with pytest.raises(vmm.VmmError, match="map failed"):
        vmm.VmmBuffer.allocate(driver, 0, 8192, 2)
    assert driver.named("unmap") == []  # nothing was mapped
    assert len(driver.named("release")) == 2 and len(driver.named("free")) == 1


def test_a_cuda_array_interface_describes_the_bytes_without_owning_them() -> None:
    face = vmm.CudaArray(0x7F0000000000, 4096).__cuda_array_interface__
    assert face["shape"] == (4096,) and face["typestr"] == "|i1" and face["data"] == (0x7F0000000000, False)


SMALL = CheckConfig(device="cpu", alloc="vmm", layers=3, blocks=8, heads=2, tokens=16, head_size=8, vmm_chunks=4)


@pytest.mark.parametrize(("storages", "registrations"), [("whole", 1), ("layer", 3)])
def test_vmm_caches_give_one_registration_or_one_per_layer(storages: str, registrations: int) -> None:
    cfg = CheckConfig(**{**SMALL.__dict__, "vmm_storages": storages})
    driver = FakeDriver(granularity=1024)
    caches, raw, buffer = vmm_caches(cfg, "cpu", driver, host_view)
    layer_bytes, total = cache_bytes(cfg)
    assert raw.numel() == total and not raw.any()
    kv = describe_kv_caches(caches, num_blocks=cfg.blocks, expected_layout=cfg.layout)
    assert len(kv.storages) == registrations
    assert [r.block_len * r.num_blocks for r in kv.regions] == [layer_bytes] * cfg.layers
    spans = vmm.spanning([(s.base, s.nbytes) for s in kv.storages], buffer.ptr, buffer.chunk_bytes)
    assert spans == (1 if storages == "whole" else 3)  # 3 layers of 8 KiB over 4 chunks of 6 KiB: each crosses one
    caches["model.layers.1.self_attn.attn"].view(torch.int8).fill_(1)
    assert int(raw[layer_bytes : 2 * layer_bytes].sum()) == layer_bytes and int(raw.sum()) == layer_bytes
    buffer.close()
