"""RayKVConnector: vLLM KV connector that moves a request's KV blocks through Ray's object store.

Load it by module path (a name registered in the parent process does not reach vLLM's children):

    KVTransferConfig(kv_connector="RayKVConnector",
                     kv_connector_module_path="kv_transfer.ray_connector",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both", engine_id=<unique id>,
                     kv_load_failure_policy="recompute" | "fail",
                     kv_connector_extra_config={"ray_address": ..., "ray_namespace": ...,
                                                "lease_registry": ..., "lease_seconds": 60})

or get it from the `ray` backend: `make_backend(TransferSettings(backend="ray", ...))
.transfer_config(engine_id, role)`. Request and output `kv_transfer_params` shapes are in
ray_params.py. The facade only forwards: RayKVScheduler (ray_scheduler.py) runs in the scheduler,
RayKVWorker (ray_worker.py) next to the KV cache. Calls, in order per step:

    scheduler  get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta
    worker     start_load_kv (starts loads, off the engine thread) -> forward
               -> wait_for_save (saves) -> get_transfer_results (loads done)
    scheduler  update_connector_output; request_finished once per finished request

Supports one worker per engine (tensor and pipeline parallel size 1) and one KV cache group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.ray_cluster import join_ray
from kv_transfer.ray_lease import get_lease_registry
from kv_transfer.ray_metadata import RayKVConnectorMetadata
from kv_transfer.ray_params import RayKVSettings
from kv_transfer.ray_scheduler import RayKVScheduler
from kv_transfer.ray_stats import RayKVConnectorStats
from kv_transfer.ray_worker import RayKVWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class RayKVConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("RayKVConnector supports tensor/pipeline parallel size 1 only")
        if not transfer.engine_id:
            raise ValueError("RayKVConnector needs KVTransferConfig.engine_id")
        settings = RayKVSettings.from_extra_config(transfer.kv_connector_extra_config)
        join_ray(settings.ray_address, settings.ray_namespace, settings.node_ip)
        registry = get_lease_registry(settings.lease_registry, settings.ray_namespace)
        self._block_size: int = vllm_config.cache_config.block_size
        self._scheduler: RayKVScheduler | None = None
        self._worker: RayKVWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = RayKVScheduler(
                settings, transfer.engine_id, self._block_size, registry
            )
        else:
            self._worker = RayKVWorker(settings, transfer.engine_id, registry)

    @property
    def scheduler(self) -> RayKVScheduler:
        assert self._scheduler is not None, "scheduler-side call on the worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> RayKVWorker:
        assert self._worker is not None, "worker-side call on the scheduler-side connector"
        return self._worker

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config
        layout_fields = {
            "block_size": self._block_size,
            "num_kv_heads": model.get_num_kv_heads(self._vllm_config.parallel_config),
            "head_size": model.get_head_size(),
            "cache_layout": self._vllm_config.cache_config.kv_cache_layout or "",
        }
        self.worker.register_kv_caches(kv_caches, layout_fields, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        self.worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request loads, off the engine thread (ray_worker.py)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves read the paged cache after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RayKVConnectorMetadata)
        self.worker.save(meta.saves)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._worker is None else self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return RayKVConnectorStats(data=data) if data is not None else RayKVConnectorStats()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self.worker.take_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    # -- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks are transferred, not a prefix-cache store.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RayKVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)
