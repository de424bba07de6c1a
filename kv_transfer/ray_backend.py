"""The `ray` backend: our own vLLM connector (`kv_transfer.ray_connector.RayKVConnector`) moves
a request's KV blocks through Ray's object store, layer by layer, with a checksum per block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kv_transfer.base import KVBackend, register_backend
from kv_transfer.handoff import NixlPull, RayPull

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


@register_backend
class RayBackend(KVBackend):
    name = "ray"
    required_modules = ("ray",)
    # Leases live in the registry: a second release is a no-op, and a consumer still reading
    # holds its own refs and checks every block.
    release_is_idempotent = True

    def _config(self, engine_id: str, role: str) -> KVTransferConfig:
        from vllm.config import KVTransferConfig

        return KVTransferConfig(
            kv_connector="RayKVConnector",
            kv_connector_module_path="kv_transfer.ray_connector",
            kv_role=role,
            engine_id=engine_id,
            kv_load_failure_policy=self.settings.failure_policy,
            kv_connector_extra_config={
                "ray_address": self.settings.ray_address,
                "ray_namespace": self.settings.ray_namespace,
                "lease_registry": self.settings.lease_registry,
                "lease_seconds": self.settings.lease_seconds,
            },
        )

    def producer_config(self, engine_id: str) -> KVTransferConfig:
        return self._config(engine_id, "kv_producer")

    def consumer_config(self, engine_id: str) -> KVTransferConfig:
        return self._config(engine_id, "kv_consumer")

    def parse_producer_output(self, params: dict[str, Any]) -> RayPull:
        if "ray_kv" not in params:
            raise ValueError(
                f"ray backend: producer output has no 'ray_kv' entry: {sorted(params)}"
            )
        return RayPull.from_producer_params(params["ray_kv"])

    def consumer_request_params(self, pull: NixlPull | RayPull) -> dict[str, Any]:
        if not isinstance(pull, RayPull):
            raise TypeError(f"ray backend got a {type(pull).__name__}")
        return {"do_remote_prefill": True, "ray_kv": pull.params}
