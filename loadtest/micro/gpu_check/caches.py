"""The GPU check's KV cache, allocated the way vLLM allocates it: one ``int8`` buffer and a ``[B, H, N, C]`` view
per layer over it, layer-compact, either from torch's allocator (vLLM 0.32: one cudaMalloc'd buffer) or in one CUDA
virtual address range over physical chunks (vLLM 0.34's extensible KV cache: vmm.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from loadtest.micro.gpu_check.config import CheckConfig
    from loadtest.micro.gpu_check.vmm import Driver, VmmBuffer


def cache_bytes(cfg: CheckConfig) -> tuple[int, int]:
    """(bytes of one layer, bytes of the whole cache)."""
    elt = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.dtype]
    layer = cfg.heads * cfg.tokens * 2 * cfg.head_size * elt * cfg.blocks
    return layer, layer * cfg.layers


def _layer_view(cfg: CheckConfig, typed: torch.Tensor, offset: int) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` view from element ``offset`` of ``typed``, in ``cfg.layout`` (LBHNC: head-major
    block interior; LBNHC: token-major). C = K and V of one head."""
    import torch

    content = 2 * cfg.head_size
    page = cfg.heads * cfg.tokens * content  # elements
    if cfg.layout == "LBHNC":
        strides = (page, cfg.tokens * content, content, 1)
    else:  # LBNHC
        strides = (page, content, cfg.heads * content, 1)
    return torch.as_strided(typed, (cfg.blocks, cfg.heads, cfg.tokens, content), strides, storage_offset=offset)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def vllm_like_caches(cfg: CheckConfig, device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One zeroed ``int8`` buffer and one ``[B, H, N, C]`` view per layer over it, layer-compact (``_layer_view``)."""
    import torch

    layer_bytes, total = cache_bytes(cfg)
    raw = torch.zeros(total, dtype=torch.int8, device=device)
    typed = raw.view(getattr(torch, cfg.dtype))
    per_layer = layer_bytes // typed.element_size()
    return {layer_name(i): _layer_view(cfg, typed, i * per_layer) for i in range(cfg.layers)}, raw


Viewer = Callable[[int, int], "torch.Tensor"]  # (address, bytes) -> an int8 tensor over it, with its own storage


def vmm_caches(
    cfg: CheckConfig, device: str, driver: Driver | None = None, viewer: Viewer | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor, VmmBuffer]:
    """The same caches in one CUDA virtual address range backed by ``cfg.vmm_chunks`` physical allocations (vmm.py);
    the layers' views share one storage (``vmm_storages`` whole) or each have their own (layer, as vLLM 0.34 hands
    them to a connector). ``driver`` and ``viewer`` default to CUDA's (tests: host memory)."""
    import torch

    from loadtest.micro.gpu_check import vmm

    if driver is None:
        torch.zeros(1, device=device)  # the device's primary context exists and is current: the driver calls use it
        driver = vmm.CudaDriver()
    view = viewer or (lambda ptr, nbytes: vmm.as_tensor(ptr, nbytes, device))
    layer_bytes, total = cache_bytes(cfg)
    buffer = vmm.VmmBuffer.allocate(driver, torch.device(device).index or 0, total, cfg.vmm_chunks, cfg.vmm_rdma)
    try:
        dtype = getattr(torch, cfg.dtype)
        raw = view(buffer.ptr, total)
        raw.zero_()  # physical pages come uninitialised
        if cfg.vmm_storages == "whole":
            typed = raw.view(dtype)
            per_layer = layer_bytes // typed.element_size()
            caches = {layer_name(i): _layer_view(cfg, typed, i * per_layer) for i in range(cfg.layers)}
        else:
            layers = [view(buffer.ptr + i * layer_bytes, layer_bytes).view(dtype) for i in range(cfg.layers)]
            caches = {layer_name(i): _layer_view(cfg, t, 0) for i, t in enumerate(layers)}
    except BaseException:
        buffer.close()
        raise
    return caches, raw, buffer
