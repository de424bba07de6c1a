"""The `ray` backend: our own vLLM connector (`kv_transfer.ray_connector.RayKVConnector`) moves
a request's KV blocks through Ray's object store, layer by layer, with a checksum per block."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engine.messages import KVPull, RayPull
from kv_transfer.base import KVBackend, register_backend

logger = logging.getLogger(__name__)

# The longest an abort waits on the lease registry.
REGISTRY_CALL_TIMEOUT_S = 5.0


@register_backend
class RayBackend(KVBackend):
    name = "ray"
    required_modules = ("ray",)
    # Leases live in the registry: a second release is a no-op, and a consumer still reading
    # holds its own refs and checks every block.
    release_is_idempotent = True

    connector = "RayKVConnector"
    connector_module = "kv_transfer.ray_connector"

    def connector_extra_config(self) -> dict[str, Any]:
        return {
            "ray_address": self.settings.ray_address,
            "ray_namespace": self.settings.ray_namespace,
            "node_ip": self.settings.node_ip,
            "lease_registry": self.settings.lease_registry,
            "lease_seconds": self.settings.lease_seconds,
            "fetch_timeout_s": self.settings.transfer_timeout_s,
        }

    def producer_request_params(self, producer_id: str, request_id: str) -> dict[str, Any]:
        from kv_transfer.ray_params import OWNER_PARAM, lease_owner_id

        return {"do_remote_decode": True, OWNER_PARAM: lease_owner_id(producer_id, request_id)}

    async def release_abandoned(self, producer_id: str, request_id: str) -> None:
        # The engine may have finished the prompt (and registered its lease) just before the
        # abort reached it; vLLM then drops the output, and with it the only copy of the key.
        from kv_transfer.ray_params import lease_owner_id

        owner = lease_owner_id(producer_id, request_id)
        try:
            await self._registry_call("release_owner", owner)
        except Exception:  # the abort goes on; an unreleased lease expires after its lease
            logger.exception("ray backend: releasing the leases of %s failed", owner)

    async def num_stored_handoffs(self, producer_id: str) -> int:
        # The layers are objects the producer's engine process put in Ray's object store: they
        # are lost with that process, so a stopping producer waits for its leases to end.
        return int(await self._registry_call("num_live", producer_id))

    async def _registry_call(self, method: str, *args: Any) -> Any:
        """One call of the lease registry's `method`, bounded to REGISTRY_CALL_TIMEOUT_S."""
        from kv_transfer.ray_lease import get_lease_registry

        registry = get_lease_registry(self.settings.lease_registry, self.settings.ray_namespace)
        return await asyncio.wait_for(
            getattr(registry, method).remote(*args), REGISTRY_CALL_TIMEOUT_S
        )

    def parse_producer_output(self, params: dict[str, Any]) -> RayPull:
        if "ray_kv" not in params:
            raise ValueError(
                f"ray backend: producer output has no 'ray_kv' entry: {sorted(params)}"
            )
        return RayPull.from_producer_params(params["ray_kv"])

    def consumer_request_params(self, pull: KVPull) -> dict[str, Any]:
        if not isinstance(pull, RayPull):
            raise TypeError(f"ray backend got a {type(pull).__name__}")
        return {"do_remote_prefill": True, "ray_kv": pull.params}
