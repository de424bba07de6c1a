"""The `ray` backend: our own vLLM connector (`kv_transfer.ray_connector.RayKVConnector`) moves
a request's KV blocks through Ray's object store, layer by layer, with a checksum per block."""

from __future__ import annotations

from typing import Any

from engine.messages import NixlPull, RayPull
from kv_transfer.base import KVBackend, register_backend


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
        }

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
