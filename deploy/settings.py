"""AppConfig -> the frozen settings record each deployment takes: `ReplicaSettings` per engine
pool, `RouterSettings` for the ingress. Built by `build_app`; nothing here starts or resolves
anything (the replicas resolve their model on the node that serves it)."""

from __future__ import annotations

from control.store import LoadPublisher
from deploy.config import AppConfig, PoolName
from engine.settings import EngineSpec
from kv_transfer.base import TransferSettings
from prefill_workers.replica import ReplicaSettings
from router.admission import AdmissionLimits
from router.auth import ApiKeys
from router.ingress import RouterSettings


def engine_spec(config: AppConfig, pool: PoolName) -> EngineSpec:
    engine = config.engine
    cores = config.pools[pool].cpu_cores
    per_replica = config.pools[pool].cores_per_replica
    return EngineSpec(
        model=engine.model,
        device=engine.device,
        dtype=engine.dtype,
        block_size=engine.block_size,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        seed=engine.seed,
        cpu_cores=tuple(cores) if cores else None,
        cores_per_replica=per_replica,
        core_group=f"{config.name}.{pool}",
        gpu_memory_utilization=engine.gpu_memory_utilization,
        served_model_name=engine.served_name,
        sim=engine.sim.spec() if engine.sim else None,
        engine_kwargs=config.engine_kwargs(pool),
    )


def transfer_settings(config: AppConfig) -> TransferSettings:
    """The app's KV transfer; each replica adds its cluster's address
    (`kv_transfer.endpoint.served_transfer_settings`)."""
    transfer = config.kv_transfer
    return TransferSettings(
        backend=transfer.backend,
        failure_policy=transfer.failure_policy,
        lease_seconds=transfer.lease_seconds,
        transfer_timeout_s=transfer.transfer_timeout_s,
        listen_host=transfer.host,
        ray_namespace="pdserve",
        lease_registry=f"pdserve-kv-leases-{config.name}",
    )


def replica_settings(config: AppConfig, pool: PoolName) -> ReplicaSettings:
    url = config.control.redis_url
    # Only the pools the autoscaler and `pdserve status` know publish their load.
    status = LoadPublisher(url, config.name) if url and pool != "engine" else None
    return ReplicaSettings(
        app=config.name,
        engine=engine_spec(config, pool),
        transfer=None if pool == "engine" else transfer_settings(config),
        status=status,
        window_s=config.autoscaling.window_s,
        percentile=config.autoscaling.percentile,
        stream_interval=config.engine.stream_interval,
    )


def router_settings(config: AppConfig, release_is_idempotent: bool = False) -> RouterSettings:
    router = config.router
    return RouterSettings(
        app=config.name,
        model=config.engine.model,
        served_name=config.engine.served_name,
        max_model_len=config.engine.max_model_len,
        max_tokens_limit=router.max_tokens_limit,
        default_max_tokens=router.default_max_tokens,
        admission=AdmissionLimits(router.max_in_flight, router.max_queued_prompt_tokens),
        colocated=config.topology == "colocated",
        release_is_idempotent=release_is_idempotent,
        control_url=config.control.redis_url,
        api_keys=_api_keys(router.api_keys_file),
        max_prompt_chars=router.max_prompt_chars,
        max_stop_chars=router.max_stop_chars,
        max_messages=router.max_messages,
        max_structured_chars=router.max_structured_chars,
        max_body_bytes=router.max_body_bytes,
        max_migrations=router.max_migrations,
        request_timeout_s=router.request_timeout_s,
        local_prefill_max_tokens=router.local_prefill_max_tokens,
        key_limit_timeout_s=router.key_limit_timeout_s,
        adaptive_prefill_tpot_s=config.autoscaling.tpot_p95_s if router.adaptive_prefill else None,
        adaptive_stall_budget=router.adaptive_stall_budget,
        adaptive_itl_s=router.adaptive_itl_s,
    )


def _api_keys(path: str | None) -> ApiKeys | None:
    if path is None:
        return None
    try:
        return ApiKeys.load(path)
    except ValueError as exc:
        raise ValueError(f"router.api_keys_file: {exc}") from None
