"""KVEndpoint: a served vLLM engine at one end of the KV transfer, producer or consumer.

What the prefill and decode workers share: the engine's settings and transfer backend, its
KVLayout for the handshake, starting the AsyncLLM with the role's connector, stats, aborting,
the strict idle check and shutdown. The workers add their half of the request lifecycle.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from engine.async_engine import ServedEngine, start_async_engine
from engine.settings import EngineSettings
from kv_transfer.base import Role, TransferSettings, make_backend
from kv_transfer.layout import kv_layout_for


class KVEndpoint(ServedEngine):
    role: Role
    id_prefix: str

    def __init__(
        self, settings: EngineSettings, transfer: TransferSettings, worker_id: str | None = None
    ) -> None:
        super().__init__(worker_id or f"{self.id_prefix}-{uuid.uuid4().hex[:8]}")
        self.settings = settings
        self.transfer = transfer
        self.backend = make_backend(transfer)
        self.layout = kv_layout_for(settings)

    def start(self) -> None:
        self.engine, self.start_seconds = start_async_engine(
            self.settings,
            self.backend.transfer_config(self.worker_id, self.role),
            self.backend.process_env(),
            self.stats,
        )


def served_transfer_settings(transfer: TransferSettings) -> TransferSettings:
    """`transfer` as a Serve replica runs it: the engine announces (nixl) and joins Ray from
    (ray) its node's address, never "localhost"; the `ray` backend's engine processes join this
    replica's cluster, and the app's lease registry is started (detached) by whichever replica
    comes first."""
    import ray

    transfer = replace(transfer, node_ip=ray.util.get_node_ip_address())
    if transfer.backend != "ray":
        return transfer
    from kv_transfer.ray_lease import start_lease_registry

    joined = replace(transfer, ray_address=ray.get_runtime_context().gcs_address)
    start_lease_registry(joined.lease_registry, joined.ray_namespace, detached=True)
    return joined
