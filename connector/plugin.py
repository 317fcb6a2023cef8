"""The class vLLM loads (``kv_connector_module_path="connector.plugin"``): a role switch that
delegates every hook to ``connector.scheduler.SchedulerHalf`` or ``connector.worker.WorkerHalf``.

Launch (P and D differ only in ``kv_role`` and ``engine_id``)::

    --kv-transfer-config '{"kv_connector":"KvpushConnector","kv_connector_module_path":"connector.plugin",
                           "kv_role":"kv_producer","engine_id":"p0","kv_buffer_device":"cpu"}'

The side channel listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST``:``VLLM_NIXL_SIDE_CHANNEL_PORT`` (the same
variables as upstream NIXL, so routers and launchers need no change): the port of rank (0, 0) of DP engine ``i`` is
``base + i * TP * PP``, rank ``(pp, tp)`` adds ``pp * TP + tp`` (``connector.kvcache.side_channel_port``,
``connector.parallel.ranks``). TP > 1 is served rank by rank; PP > 1 on a prefill stage by stage
(decode: refused at startup).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from connector.kvcache import REQUESTED_LAYOUT, check_parallelism, side_channel_port
from connector.options import Options
from connector.scheduler import Ending, SchedulerHalf
from connector.stats import KvpushPromMetrics, KvpushStats
from connector.wire.plan import StepPlan
from connector.worker import WorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


_ENDINGS = {
    RequestStatus.FINISHED_STOPPED: Ending.OK,
    RequestStatus.FINISHED_LENGTH_CAPPED: Ending.OK,
    RequestStatus.FINISHED_ERROR: Ending.ERROR,
}


class KvpushMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The step plan, as the metadata object vLLM carries from scheduler to workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvpushWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, per step, summed over ranks by vLLM's aggregator: per receive, how many ranks
    quarantined it in this step (reported failed and finished so vLLM fails it now; the scheduler half
    withholds the finish) and how many lifted a quarantine (its blocks freed); the receives any rank failed."""

    def __init__(
        self, quarantined: Counter[str], lifted: Counter[str] | None = None, failed: frozenset[str] = frozenset()
    ) -> None:
        self.quarantined = quarantined
        self.lifted = lifted if lifted is not None else Counter()
        self.failed = failed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvpushWorkerMeta):
            return self
        return KvpushWorkerMeta(
            self.quarantined + other.quarantined, self.lifted + other.lifted, self.failed | other.failed
        )


def _dp_index(parallel: Any) -> int:
    """This engine's data-parallel index: vLLM 0.32 resets ``data_parallel_rank`` to 0 for dense-model
    DP ranks and keeps the real one in ``data_parallel_index`` (``connector.kvcache.side_channel_port``)."""
    return int(getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0)) or 0)


def _side_channel(dp_rank: int, world_size: int = 1) -> tuple[str, int]:
    """Host and rank-0 port of this engine's side channel: base + DP index x world size."""
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    base = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
    return host, side_channel_port(base, dp_rank, world_size)


class KvpushConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vllm is untyped for mypy here
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        check_parallelism(
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            decode_context_parallel_size=getattr(parallel, "decode_context_parallel_size", 1),
            kv_role=str(vllm_config.kv_transfer_config.kv_role),
        )
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
        host, port = _side_channel(_dp_index(parallel), tp * pp)  # the engine's rank-0 port
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            options = Options.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
            block_size = int(vllm_config.cache_config.block_size)
            self._scheduler = SchedulerHalf(
                engine_id,
                host,
                port,
                block_size,
                options.early_write,
                progressive=options.progressive,
                tp_size=tp,
                pp_size=pp,
            )
        else:
            self._worker = WorkerHalf(vllm_config, engine_id, host, port)
            self._worker.set_num_blocks(kv_cache_config.num_blocks)

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvpushMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvpushWorkerMeta):
            meta = KvpushWorkerMeta(Counter())
        withheld = self._scheduler.update_connector_output(
            connector_output.finished_recving or (),
            connector_output.finished_sending or (),
            meta.quarantined,
            meta.lifted,
            meta.failed,
        )
        if withheld and connector_output.finished_recving:
            # vLLM reads finished_recving after this hook: a quarantined request's blocks stay held.
            connector_output.finished_recving.difference_update(withheld)
        lifted = self._scheduler.take_lifted()
        if lifted:  # every rank freed a quarantined receive: vLLM may free its blocks now
            connector_output.finished_recving = set(connector_output.finished_recving or ()) | lifted

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        ending = _ENDINGS.get(request.status, Ending.ABORTED)
        return self._scheduler.request_finished(request, block_ids, ending)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward: no WRITE may still read the blocks of a P leg vLLM just preempted (and freed).
        if self._worker is not None and isinstance(kv_connector_metadata, KvpushMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvpushMetadata):
            self._worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # KV arrives before the request is scheduled at all

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # push_granularity "layer": this layer's part of the step's pushes may be written now; "step": nothing
        # (prefill's blocks are pushed whole, from the end of the step that computed them)
        meta = self._get_connector_metadata() if self._worker is not None else None
        if self._worker is not None and isinstance(meta, KvpushMetadata):
            self._worker.save_layer(layer_name, meta.plan)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvpushMetadata):
            self._worker.end_of_step(meta.plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        quarantined, lifted, failed = self._worker.take_report()
        if not (quarantined or lifted or failed):
            return None
        return KvpushWorkerMeta(Counter(quarantined), Counter(lifted), failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- class hooks --------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return REQUESTED_LAYOUT  # layer-compact, block-compact pages (connector.kvcache)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM >= 0.34 (the extensible KV cache): how the workers reach the device KV cache. NIXL registers it
        with UCX (one physical allocation per registered range) and peers on one host map it through UCX
        cuda_ipc (FABRIC handles); a host KV cache (``kv_buffer_device: cpu``) asks nothing of the allocator.
        Older vLLM never calls it (``KVCacheAccess`` does not exist there)."""
        from vllm.config.kv_transfer import KVCacheAccess

        if str(getattr(kv_transfer_config, "kv_buffer_device", "")) == "cpu":
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: sleep mode remaps the KV cache under the NIXL registrations our peers write into
        (a WRITE would land in memory the engine no longer uses): refused at engine start."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpushStats(data=data) if data is not None else KvpushStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvpushPromMetrics:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
