"""The `nixl` backend: vLLM's NixlConnector (UCX; shared memory / TCP on CPU, RDMA on GPUs).

Engines load our thin subclass (`kv_transfer.nixl_connector.PdNixlConnector`) by module path,
which tames NIXL's busy-polling threads before the agent starts (see that module).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from kv_transfer.base import KVBackend, register_backend
from kv_transfer.handoff import NixlPull, RayPull

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


@register_backend
class NixlBackend(KVBackend):
    name = "nixl"
    required_modules = ("nixl",)

    def _config(self, engine_id: str, role: str) -> KVTransferConfig:
        from vllm.config import KVTransferConfig

        from engine.platform import detect_device

        return KVTransferConfig(
            kv_connector="PdNixlConnector",
            kv_connector_module_path="kv_transfer.nixl_connector",
            kv_role=role,
            engine_id=engine_id,
            kv_buffer_device="cpu" if detect_device() == "cpu" else "cuda",
            kv_load_failure_policy=self.settings.failure_policy,
            # num_threads 0: UCX's extra progress thread spins half a core on CPU hosts.
            kv_connector_extra_config={
                "num_threads": 0,
                "kv_lease_duration": int(self.settings.lease_seconds),
            },
        )

    def producer_config(self, engine_id: str) -> KVTransferConfig:
        return self._config(engine_id, "kv_producer")

    def consumer_config(self, engine_id: str) -> KVTransferConfig:
        return self._config(engine_id, "kv_consumer")

    def parse_producer_output(self, params: dict[str, Any]) -> NixlPull:
        return NixlPull.from_producer_params(params)

    def consumer_request_params(self, pull: NixlPull | RayPull) -> dict[str, Any]:
        if not isinstance(pull, NixlPull):
            raise TypeError(f"nixl backend got a {type(pull).__name__}")
        return pull.to_consumer_params(flat_blocks=False)

    def process_env(self) -> dict[str, str]:
        # Every engine listens for handshakes; two on one host need two ports.
        port = self.settings.nixl_port or free_port()
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
