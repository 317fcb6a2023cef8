"""The ready seam: a WRITE never reads blocks before the forward pass that computes them has finished.

vLLM calls ``wait_for_save`` right after it *launched* the step's forward. On CPU the forward is
synchronous, so the KV already sits in the blocks; on a GPU the kernels may still be running, and a
WRITE posted then (early write G10, progressive push G14) would read stale blocks: silent wrong KV.
So the worker records a ``ReadyEvent`` on the forward stream in ``wait_for_save`` (``StepFence.record``)
and hands it with the step's orders to the transfer thread, which feeds an order to its machines (and
so can post its WRITE) only once ``query()`` says the event completed (``TransferThread``: orders are
kept in submission order behind the first one not ready yet).

Which fence: ``fence_for`` picks ``CudaFence`` for VRAM KV caches and ``HostFence`` otherwise.
``StepFence.bind_thread`` runs on the owner thread before its first backend call: for CUDA it makes
the KV cache's device current on that thread (UCX disables cuda_ipc without a current context).

``CudaFence`` has not run on a GPU yet (no device was lent to the work that wrote it); CPU tests
prove the ordering through a fake fence (``tests/unit/connector/transfer/test_ready.py``).
"""

from __future__ import annotations

from typing import Any, Protocol


class ReadyEvent(Protocol):
    def query(self) -> bool:
        """True once everything recorded before the event (the step's kernels) has finished."""


class StepFence(Protocol):
    def record(self) -> ReadyEvent:
        """Worker thread, in ``wait_for_save``: mark the end of this step's forward."""

    def bind_thread(self) -> None:
        """Owner thread, before any backend call: make the KV cache's device current."""


class _Ready:
    def query(self) -> bool:
        return True


READY: ReadyEvent = _Ready()  # an event that completed already (host memory: the forward was synchronous)


class HostFence:
    """DRAM KV caches: the forward ran synchronously on the worker thread, so every step is ready."""

    def record(self) -> ReadyEvent:
        return READY

    def bind_thread(self) -> None:
        return None


class _CudaReady:
    def __init__(self, event: Any) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())


class CudaFence:
    """VRAM KV caches: a CUDA event recorded on the device's current (forward) stream."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def record(self) -> ReadyEvent:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_id))
        return _CudaReady(event)

    def bind_thread(self) -> None:
        import torch

        torch.cuda.set_device(self.device_id)


def fence_for(mem_type: str, device_id: int) -> StepFence:
    """``CudaFence`` for VRAM, ``HostFence`` for DRAM (``connector.kvcache`` refuses host staging)."""
    if mem_type == "VRAM":
        return CudaFence(device_id)
    return HostFence()
