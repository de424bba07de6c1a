"""The `nixl` backend: vLLM's NixlConnector (UCX; shared memory / TCP on CPU, RDMA on GPUs).

Engines load our thin subclass (`kv_transfer.nixl_connector.PdNixlConnector`) by module path,
which tames NIXL's busy-polling threads before the agent starts (see that module).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from engine.messages import KVPull, NixlPull
from engine.ports import free_port
from kv_transfer.base import KVBackend, register_backend


@register_backend
class NixlBackend(KVBackend):
    name = "nixl"
    required_modules = ("nixl",)

    connector = "PdNixlConnector"
    connector_module = "kv_transfer.nixl_connector"

    def connector_extra_config(self) -> dict[str, Any]:
        # num_threads 0: UCX's extra progress thread spins half a core on CPU hosts.
        return {
            "num_threads": 0,
            "kv_lease_duration": int(self.settings.lease_seconds),
            "pd_transfer_timeout_s": self.settings.transfer_timeout_s,
        }

    def kv_buffer_device(self) -> str:
        from engine.platform import detect_device

        return "cpu" if detect_device() == "cpu" else "cuda"

    def parse_producer_output(self, params: dict[str, Any]) -> NixlPull:
        return NixlPull.from_producer_params(params)

    def consumer_request_params(self, pull: KVPull) -> dict[str, Any]:
        if not isinstance(pull, NixlPull):
            raise TypeError(f"nixl backend got a {type(pull).__name__}")
        return pull.to_consumer_params(flat_blocks=False)

    def process_env(self) -> dict[str, str]:
        # Every engine listens for handshakes; two on one host need two ports. The producer
        # announces VLLM_NIXL_SIDE_CHANNEL_HOST in its handoff: vLLM's default, "localhost",
        # sent a decode engine on another host to its own loopback (handshake timeout, then a
        # silent recompute of the whole prompt).
        host = self.settings.engine_host
        port = self.settings.nixl_port or free_port(host)
        env = {
            **super().process_env(),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        }
        if ipaddress.ip_address(host).is_loopback:
            # UCX's TCP transport listens on every network device unless told otherwise.
            env["UCX_NET_DEVICES"] = "lo"
        return env
