"""Worker-side half: describes the paged KV cache, owns the transfer thread, relays step orders.

The KV caches are described (or refused, with the reason) by ``connector.kvcache``: layout from the
tensors' strides, memory type from their device, one NIXL registration per backing storage, and the
fields of the compatibility hash (layout, attention backend, head geometry, kernel block size, vLLM
version, dtypes, model).

Runs in vLLM's worker process on the model runner's thread. ``start_load_kv`` only puts orders
in the transfer thread's inbox and ``get_transfer_results`` only empties its outbox, so the forward
loop never waits on NIXL. Threads it does not own are left where they are (no affinity changes).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connector.kvcache import KVCaches, compatibility_fields, compatibility_signature, describe_kv_caches
from connector.options import Options
from connector.orders import CancelOrder, Order
from connector.parallel.ranks import layer_window, rank_port
from connector.parallel.topology import heads_of
from connector.stats import KvpushStats
from connector.transfer.base import TransferBackend
from connector.transfer.layered import LayeredBackend, StepLayers
from connector.transfer.nixl import NixlBackend
from connector.transfer.ready import READY, HostFence, StepFence, fence_for
from connector.transfer_thread import TransferThread
from connector.wire.metadata import RankId, RankInfo, compatibility_hash
from connector.wire.plan import StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def this_rank() -> RankId:
    """This worker's (pp, tp) rank in its engine (vLLM's model-parallel groups are set up by now)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return RankId(int(get_pp_group().rank_in_group), int(get_tp_group().rank_in_group))


class WorkerHalf:
    _layer_index: Mapping[str, int] = MappingProxyType({})  # push_granularity "layer": layer name -> region
    _step_layers: StepLayers | None = None  # this step's, while it computes prompt blocks to push (layer-wise)
    _started: StepPlan | None = None  # the step whose orders went in (layer-wise: at most once per step)

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, side_host: str, side_port: int, rank: RankId | None = None
    ) -> None:
        """``side_port``: the engine's rank-0 port; this rank listens on ``connector.parallel.ranks.rank_port``."""
        kv_config = vllm_config.kv_transfer_config
        # Unknown keys are refused here, at engine start, with the list of known ones.
        self._options = Options.from_extra(kv_config.kv_connector_extra_config)
        self.engine_id = engine_id
        self._vllm_config = vllm_config
        parallel = vllm_config.parallel_config
        self._tp, self._pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
        self._rank = rank if rank is not None else (this_rank() if self._tp * self._pp > 1 else RankId(0, 0))
        self._side_host, self._side_port = side_host, rank_port(side_port, self._rank, self._tp)
        self._kv_buffer_device = kv_config.kv_buffer_device
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = 0
        self._thread: TransferThread | None = None
        self._stats = KvpushStats()
        self._quarantined: set[str] = set()  # reported quarantined since the last worker metadata
        self._lifted: set[str] = set()  # quarantines freed since the last worker metadata
        self._failed: set[str] = set()  # receives failed since the last worker metadata
        self._quarantining: set[str] = set()  # quarantined, not yet freed
        self._fence: StepFence = HostFence()

    def set_num_blocks(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cache_config = self._vllm_config.cache_config
        caches = describe_kv_caches(
            kv_caches,
            num_blocks=self._num_blocks,
            kv_buffer_device=self._kv_buffer_device,
            expected_layout=getattr(cache_config, "kv_cache_layout", None),
        )  # raises KVCacheUnsupported (a ValueError) with the reason: the engine fails at startup
        layout = caches.layout(self._block_size)
        # Unique per incarnation: a restarted peer (same engine id, even the same pid) is a new agent.
        name = f"kvpush-{self.engine_id}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        backend: TransferBackend = NixlBackend(
            name,
            layout,
            self._options.backends,
            registrations=caches.registrations(),
            progress_thread_delay_us=self._options.progress_thread_delay_us(self._side_host),
        )
        self._fence = fence_for(caches.mem_type, caches.device_id)  # CUDA event + device for VRAM
        if self._options.push_granularity == "layer":
            backend = LayeredBackend(backend, len(layout.regions), layout.regions[0].block_len)
            self._layer_index = {layer: i for i, layer in enumerate(caches.layers)}
        self._thread = TransferThread(
            backend,
            engine_id=self.engine_id,
            layout=layout,
            compat_hash=compatibility_hash(self._signature(caches), layout),
            side_host=self._side_host,
            side_port=self._side_port,
            options=self._options,
            fence=self._fence,
            rank=self._rank_info(caches),
        )
        self._thread.start()
        logger.info(
            "kvpush: %d KV regions of %d blocks (%s, %s) in %d registration(s); side channel on %s:%d",
            len(layout.regions),
            self._num_blocks,
            caches.mem_type,
            caches.geometry.layout,
            len(caches.storages),
            self._side_host,
            self._thread.side_port,
        )

    def _rank_info(self, caches: KVCaches) -> RankInfo:
        total = int(self._vllm_config.model_config.get_total_num_kv_heads())
        heads = heads_of(self._rank.tp, self._tp, total)
        g = caches.geometry  # LBHNC: a block of a region is its heads one after the other
        # Head slices need LBHNC pages without padding; otherwise only whole blocks (equal TP) can pair.
        sliceable = g.num_heads == len(heads) and g.layout == "LBHNC" and g.block_len == g.page_bytes
        head_bytes = g.page_bytes // g.num_heads if sliceable else 0
        return RankInfo(self._tp, self._pp, self._rank, total, heads, head_bytes, layer_window(caches.layers, self._pp))

    def _signature(self, caches: KVCaches) -> str:
        config = self._vllm_config
        model = config.model_config
        try:
            attn_backend = get_current_attn_backends(config)[0].get_name()
        except (IndexError, AttributeError, ValueError):  # both sides then agree on "unknown"
            attn_backend = "unknown"
        fields = compatibility_fields(
            caches,
            model=str(model.model),
            model_dtype=str(model.dtype),
            cache_dtype=str(config.cache_config.cache_dtype),
            attn_backend=str(attn_backend),
            num_kv_heads=int(model.get_total_num_kv_heads()),  # the model's: ranks of unequal TP may pair
            head_size=int(model.get_head_size()),
            block_size=int(self._block_size),
            vllm_version=str(vllm.__version__),
        )
        return compatibility_signature(fields)

    def handle_preemptions(self, plan: StepPlan) -> None:
        """``handle_preemptions``, before the step's forward (vLLM 0.32-0.34, both model runners): P legs vLLM
        preempted have their blocks freed already and this forward may overwrite them. Their partial WRITEs
        stop, and this waits until none of them is in flight (bounded: ``TransferThread.quiesce``). Only a
        preemption of a leg that ordered a WRITE gets here: rare, and a WRITE of a few blocks is short."""
        if self._thread is None or not plan.preempted:
            return
        keys = frozenset(p.key for p in plan.preempted)
        if not self._thread.quiesce(keys):
            logger.error("kvpush: preempted %s: a WRITE may read blocks vLLM freed", sorted(keys))

    def start(self, plan: StepPlan) -> None:
        """``start_load_kv``: the step's orders. vLLM calls it before the forward only when the step has sync
        KV loads, else after the forward (vLLM 0.32): layer-wise, the first ``save_layer`` of the step starts
        it instead (its pushes must be ordered before their layers are marked), and this call is then a no-op."""
        if self._thread is None or plan.is_empty() or self._started is plan:
            return
        if self._layer_index:
            self._started = plan
        orders: list[Order] = [
            *plan.register,
            *(CancelOrder(r) for r in plan.cancel),
            *plan.cancel_unallocated,
            *plan.restarted,
            *plan.finished,
            *plan.failed,
        ]
        for order in orders:
            self._thread.submit(order)
        if self._layer_index and (plan.progress or plan.completing):
            # Layer-wise: the step's pushes reach the machines now; their WRITEs' parts wait for the layers
            # that ``save_layer`` marks (connector.transfer.layered), the rest for ``end_of_step``.
            self._step_layers = StepLayers(len(self._layer_index))
            pushes: list[Order] = [*plan.progress, *plan.completing]
            for push in pushes:
                self._thread.submit(push, READY, self._step_layers)

    def save_layer(self, layer_name: str, plan: StepPlan) -> None:
        """``save_kv_layer``: this layer's KV of the step is in the cache once an event recorded now completed.
        Only a mark and a wake-up: the owner thread posts the part (the forward never waits on NIXL). The
        step's orders go in first if ``start_load_kv`` did not come yet (``start``)."""
        if not self._layer_index:
            return
        self.start(plan)
        layers, index = self._step_layers, self._layer_index.get(layer_name)
        if layers is None or index is None or self._thread is None:
            return
        layers.mark(index, self._fence.record())
        logger.debug("kvpush layer %d marked", index)
        self._thread.kick()

    def end_of_step(self, plan: StepPlan) -> None:
        """``wait_for_save``: the forward of this step has computed the prompts in ``completing``;
        their WRITE is ordered now, not one step later (G10); so are the full blocks this step computed
        of the chunked prefills in ``progress`` (G14). The forward may only have been launched (GPU):
        one ``ReadyEvent`` recorded now on the forward stream goes with these orders, and the owner
        thread posts their WRITEs only once it completed (``connector.transfer.ready``; on CPU it is ready)."""
        if self._thread is None:
            return
        if self._layer_index:  # layer-wise: the orders went in ``start``; layers not marked are ready after the step
            if self._step_layers is not None:
                self._step_layers.close(self._fence.record())
                logger.debug("kvpush layer step closed")
                self._step_layers = None
                self._thread.kick()
            self._started = None
            return
        orders: list[Order] = [*plan.progress, *plan.completing]
        if not orders:
            return
        ready = self._fence.record()
        for order in orders:
            self._thread.submit(order, ready)

    def transfer_results(self) -> KVConnectorTransferResults:
        if self._thread is None:
            return KVConnectorTransferResults()
        self._thread.kick()  # once per engine step: the owner thread polls notices and WRITEs now
        r = self._thread.collect_results()
        if r.records or r.counters:
            self._stats.record(r.records, r.counters)
        # A quarantine (failed now, blocks held to the hold deadline) is reported finished too: vLLM's
        # output aggregator passes a failure on only with a finish. The scheduler half withholds that
        # finish (it learns the ids from ``take_report``) until every rank lifted it: the later ``Freed``
        # is reported as lifted, never as a second finish (vLLM counts one finish per rank).
        quarantined = r.failed - r.received
        lifted = r.received & self._quarantining
        self._quarantining = (self._quarantining | quarantined) - lifted
        self._quarantined |= quarantined
        self._lifted |= lifted
        self._failed |= r.failed
        return KVConnectorTransferResults(
            finished_sending=r.released,
            finished_recving=(r.received - lifted) | quarantined,
            failed_recving=r.failed - lifted,
        )

    def take_report(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """(quarantined, lifted, failed) since the last call: sent to the scheduler half in this step."""
        report = frozenset(self._quarantined), frozenset(self._lifted), frozenset(self._failed)
        self._quarantined, self._lifted, self._failed = set(), set(), set()
        return report

    def take_stats(self) -> KvpushStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvpushStats()
        return stats

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
