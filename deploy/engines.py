"""AppConfig -> the frozen records one engine replica runs with. Called inside the replica, so
built-in models are prepared on the node that serves them."""

from __future__ import annotations

from deploy.config import AppConfig, PoolName
from engine.models import resolve_model
from engine.platform import detect_device
from engine.settings import EngineSettings
from kv_transfer.base import TransferSettings


def engine_settings(config: AppConfig, pool: PoolName) -> EngineSettings:
    engine = config.engine
    device = detect_device() if engine.device == "auto" else engine.device
    cores = config.pools[pool].cpu_cores
    return EngineSettings(
        model=resolve_model(engine.model),
        device=device,
        dtype=engine.dtype,
        block_size=engine.block_size,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes if device == "cpu" else None,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        seed=engine.seed,
        cpu_cores=tuple(cores) if cores and device == "cpu" else None,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        served_model_name=engine.served_name,
    )


def transfer_settings(
    config: AppConfig, ray_address: str | None = None, node_ip: str = "127.0.0.1"
) -> TransferSettings:
    transfer = config.kv_transfer
    return TransferSettings(
        node_ip=node_ip,
        backend=transfer.backend,
        failure_policy=transfer.failure_policy,
        lease_seconds=transfer.lease_seconds,
        ray_address=ray_address,
        ray_namespace="pdserve",
        lease_registry=f"pdserve-kv-leases-{config.name}",
    )


def served_transfer_settings(config: AppConfig) -> TransferSettings:
    """TransferSettings inside a Serve replica: the engine announces (nixl) and joins Ray from
    (ray) its node's address; the `ray` backend's engine processes join this cluster, and the
    app's lease registry is started (detached) by whichever replica comes first."""
    import ray

    node_ip = ray.util.get_node_ip_address()
    if config.kv_transfer.backend != "ray":
        return transfer_settings(config, node_ip=node_ip)
    from kv_transfer.ray_lease import start_lease_registry

    settings = transfer_settings(config, ray.get_runtime_context().gcs_address, node_ip)
    start_lease_registry(settings.lease_registry, settings.ray_namespace, detached=True)
    return settings
