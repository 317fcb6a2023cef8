"""Worker-side half: describes the paged KV cache, owns the transfer thread, relays step orders.

Runs in vLLM's worker process on the model runner's thread. ``start_load_kv`` only puts orders
in the transfer thread's inbox and ``get_transfer_results`` only empties its outbox, so the forward
loop never waits on NIXL. Threads it does not own are left where they are (no affinity changes).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connector.metadata import KVLayout, Region, StepPlan, compatibility_hash
from connector.stats import KvpushStats
from connector.transfer import NixlBackend
from connector.transfer_thread import CancelOrder, Options, Order, TransferThread

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def layout_from_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int, mem_type: str) -> KVLayout:
    """One region per (layer, leading index) slice: the paged dim is the first of size ``num_blocks``;
    everything after it must be one contiguous block. Tensors sharing memory count once."""
    regions: list[Region] = []
    seen: set[int] = set()
    device_id = 0
    for name, tensor in kv_caches.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        device_id = tensor.device.index or 0
        dims = list(tensor.shape)
        if num_blocks not in dims:
            raise ValueError(f"KV cache {name} {tuple(dims)} has no dimension of {num_blocks} blocks")
        d = dims.index(num_blocks)
        inner = 1
        for size in dims[d + 1 :]:
            inner *= size
        if tensor.stride(d) != inner or not tensor[(0,) * d].is_contiguous():
            raise ValueError(f"KV cache {name}: blocks are not contiguous (stride {tensor.stride()})")
        block_len = inner * tensor.element_size()
        for lead in torch.cartesian_prod(*[torch.arange(n) for n in dims[:d]]).reshape(-1, d).tolist() if d else [[]]:
            offset = sum(i * tensor.stride(k) for k, i in enumerate(lead)) * tensor.element_size()
            regions.append(Region(tensor.data_ptr() + offset, block_len, num_blocks))
    return KVLayout(mem_type, device_id, block_size, tuple(regions))


class WorkerHalf:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, side_host: str, side_port: int) -> None:
        kv_config = vllm_config.kv_transfer_config
        # Unknown keys are refused here, at engine start, with the list of known ones.
        self._options = Options.from_extra(kv_config.kv_connector_extra_config)
        self.engine_id = engine_id
        self._side_host, self._side_port = side_host, side_port
        self._mem_type = "VRAM" if kv_config.kv_buffer_device == "cuda" else "DRAM"
        self._block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        self._model_signature = f"{model.model}|{model.dtype}|{vllm_config.cache_config.cache_dtype}"
        self._num_blocks = 0
        self._thread: TransferThread | None = None
        self._stats = KvpushStats()

    def set_num_blocks(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = layout_from_caches(kv_caches, self._num_blocks, self._block_size, self._mem_type)
        # Unique per incarnation: a restarted peer (same engine id, even the same pid) is a new agent.
        name = f"kvpush-{self.engine_id}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        backend = NixlBackend(name, layout, self._options.backends)
        self._thread = TransferThread(
            backend,
            engine_id=self.engine_id,
            layout=layout,
            compat_hash=compatibility_hash(self._model_signature, layout),
            side_host=self._side_host,
            side_port=self._side_port,
            options=self._options,
        )
        self._thread.start()
        logger.info(
            "kvpush: %d KV regions of %d blocks registered (%s); side channel on %s:%d",
            len(layout.regions),
            self._num_blocks,
            self._mem_type,
            self._side_host,
            self._thread.side_port,
        )

    def start(self, plan: StepPlan) -> None:
        if self._thread is None or plan.is_empty():
            return
        orders: list[Order] = [
            *plan.register,
            *(CancelOrder(r) for r in plan.cancel),
            *plan.cancel_unallocated,
            *plan.finished,
            *plan.failed,
        ]
        for order in orders:
            self._thread.submit(order)

    def transfer_results(self) -> KVConnectorTransferResults:
        if self._thread is None:
            return KVConnectorTransferResults()
        self._thread.kick()  # once per engine step: the owner thread polls notices and WRITEs now
        r = self._thread.collect_results()
        if r.records or r.counters:
            self._stats.record(r.records, r.counters)
        return KVConnectorTransferResults(
            finished_sending=r.released, finished_recving=r.received, failed_recving=r.failed
        )

    def take_stats(self) -> KvpushStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvpushStats()
        return stats

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
