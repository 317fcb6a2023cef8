"""KV memory the way vLLM 0.34's extensible KV cache allocates it: CUDA virtual memory management (VMM).

One virtual address range is reserved (``cuMemAddressReserve``), then backed by ``chunks`` physical allocations
(``cuMemCreate``), each mapped at its place in the range (``cuMemMap``) and made readable and writable by the
device (``cuMemSetAccess``). vLLM backs each segment with a single physical chunk only when the connector declares
that it registers memory (``KVCacheAccess.REGISTERS``): "UCX cannot RDMA a range spanning several allocations".
The GPU check (``--alloc vmm``) registers such a range with NIXL once backed by one chunk and once by several,
and reports whether registration and the WRITEs succeed (issue 38).

Pure here: the chunk plan, how many registrations span more than one chunk, the allocation's order of calls and
its undoing (over a ``Driver``: ``CudaDriver`` calls the CUDA driver through ctypes, loaded on first use; tests
give a fake), and the ``__cuda_array_interface__`` that lets torch view the range without owning it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

RDMA_CHOICES = ("auto", "on", "off")

# cuda.h (CUDA 11.2+; the names below are the driver API's)
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_NONE = 0x0
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110


class VmmError(RuntimeError):
    """A CUDA driver call of the allocation failed (its name and CUresult in the message)."""


def plan_chunks(nbytes: int, chunks: int, granularity: int) -> int:
    """Bytes of each physical chunk: ``nbytes`` split into ``chunks`` equal parts, each rounded up to the
    allocation granularity (the range is ``chunks`` times that)."""
    if nbytes <= 0 or chunks <= 0 or granularity <= 0:
        raise ValueError(f"nbytes, chunks and granularity must be positive: {nbytes}, {chunks}, {granularity}")
    per = -(-nbytes // chunks)
    return -(-per // granularity) * granularity


def spanning(regions: Sequence[tuple[int, int]], base: int, chunk_bytes: int) -> int:
    """How many ``(address, length)`` regions (NIXL registrations) cross a boundary between two chunks of a range
    that starts at ``base`` in chunks of ``chunk_bytes``."""
    return sum((addr - base) // chunk_bytes != (addr + length - 1 - base) // chunk_bytes for addr, length in regions)


class Driver(Protocol):
    """The CUDA driver calls a VMM allocation makes (``CudaDriver``; tests: a fake)."""

    def rdma_supported(self, device: int) -> bool: ...

    def granularity(self, device: int, rdma: bool) -> int: ...

    def reserve(self, size: int) -> int: ...

    def create(self, size: int, device: int, rdma: bool) -> int: ...

    def map(self, ptr: int, size: int, handle: int) -> None: ...

    def set_access(self, ptr: int, size: int, device: int) -> None: ...

    def unmap(self, ptr: int, size: int) -> None: ...

    def release(self, handle: int) -> None: ...

    def free(self, ptr: int, size: int) -> None: ...


@dataclass
class VmmBuffer:
    """A reserved range, its chunks and their mappings; ``close`` undoes them (unmap, release, free)."""

    driver: Driver
    ptr: int
    chunk_bytes: int
    rdma: bool
    reserved: int  # bytes of the range
    handles: list[int] = field(default_factory=list)
    mapped: int = 0  # chunks mapped so far, from the start of the range

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * len(self.handles)

    @classmethod
    def allocate(cls, driver: Driver, device: int, nbytes: int, chunks: int, rdma: str = "auto") -> VmmBuffer:
        """At least ``nbytes`` of device memory in one range over ``chunks`` physical allocations; ``rdma`` sets
        the chunks' gpuDirectRDMACapable flag (auto: when the device supports it with VMM)."""
        if rdma not in RDMA_CHOICES:
            raise ValueError(f"rdma must be one of {RDMA_CHOICES}, got {rdma!r}")
        flag = driver.rdma_supported(device) if rdma == "auto" else rdma == "on"
        chunk = plan_chunks(nbytes, chunks, driver.granularity(device, flag))
        buffer = cls(driver, driver.reserve(chunk * chunks), chunk, flag, chunk * chunks)
        try:
            for _ in range(chunks):
                buffer.handles.append(driver.create(chunk, device, flag))
            for i, handle in enumerate(buffer.handles):
                driver.map(buffer.ptr + i * chunk, chunk, handle)
                buffer.mapped += 1
            driver.set_access(buffer.ptr, chunk * chunks, device)
        except BaseException:
            buffer.close()
            raise
        return buffer

    def close(self) -> None:
        """Unmap what was mapped, release every chunk, free the range; once."""
        for i in range(self.mapped):
            self.driver.unmap(self.ptr + i * self.chunk_bytes, self.chunk_bytes)
        for handle in self.handles:
            self.driver.release(handle)
        if self.ptr:
            self.driver.free(self.ptr, self.reserved)
        self.mapped, self.handles, self.ptr = 0, [], 0


class CudaArray:
    """``nbytes`` bytes of device memory at ``ptr`` as a ``__cuda_array_interface__`` (version 2): torch can view
    it without owning it (``as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|i1", "data": (self.ptr, False), "version": 2, "strides": None}


def as_tensor(ptr: int, nbytes: int, device: str) -> torch.Tensor:
    """An ``int8`` tensor over device memory it does not own (each call: a storage of its own)."""
    import torch

    return torch.as_tensor(CudaArray(ptr, nbytes), device=device)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriver:
    """The driver calls through ctypes on libcuda (the process's current context: torch made it current)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self._lib: Any = None
        self._library = library

    def _call(self, name: str, *args: Any) -> None:
        if self._lib is None:
            self._lib = ctypes.CDLL(self._library)
            self._check("cuInit", self._lib.cuInit(0))
        self._check(name, getattr(self._lib, name)(*args))

    def _check(self, name: str, code: int) -> None:
        if code:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorName(code, ctypes.byref(text))
            raise VmmError(f"{name} failed: CUresult {code} ({(text.value or b'?').decode()})")

    def _attribute(self, device: int, attribute: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        return value.value

    def rdma_supported(self, device: int) -> bool:
        if not self._attribute(device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
            raise VmmError(f"device {device} has no virtual memory management")
        return bool(self._attribute(device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED))

    @staticmethod
    def _prop(device: int, rdma: bool) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type, prop.requestedHandleTypes = CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_NONE
        prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
        prop.allocFlags.gpuDirectRDMACapable = int(rdma)
        return prop

    def granularity(self, device: int, rdma: bool) -> int:
        out = ctypes.c_size_t()
        prop = self._prop(device, rdma)
        self._call(
            "cuMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )
        return out.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_uint64(0),
        )
        return ptr.value

    def create(self, size: int, device: int, rdma: bool) -> int:
        handle = ctypes.c_uint64()
        prop = self._prop(device, rdma)
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0))
        return handle.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        args = (ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle))
        self._call("cuMemMap", *args, ctypes.c_uint64(0))

    def set_access(self, ptr: int, size: int, device: int) -> None:
        desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._call(
            "cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)
        )

    def unmap(self, ptr: int, size: int) -> None:
        self._call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", ctypes.c_uint64(handle))

    def free(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))
