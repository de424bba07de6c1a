"""The `sim` backend: the KV of simulated engines (engine/sim/). Nothing moves; the producer's
output names how many tokens and bytes it computed, and the consumer engine waits the time
those bytes take on its link before it decodes. It needs no package and no connector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.messages import KVPull, SimPull
from kv_transfer.base import KVBackend, Role, register_backend

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


@register_backend
class SimBackend(KVBackend):
    name = "sim"
    connector = ""
    connector_module = ""
    # The producer's blocks return to its cache when its prefill ends: a release is a no-op.
    release_is_idempotent = True

    def transfer_config(self, engine_id: str, role: Role) -> KVTransferConfig | None:
        return None

    def connector_extra_config(self) -> dict[str, Any]:
        return {}

    def process_env(self) -> dict[str, str]:
        return {}

    def producer_request_params(self, producer_id: str, request_id: str) -> dict[str, Any]:
        return {"do_remote_decode": True, "sim_producer": producer_id}

    def parse_producer_output(self, params: dict[str, Any]) -> SimPull:
        if "sim_kv" not in params:
            raise ValueError(
                f"sim backend: producer output has no 'sim_kv' entry: {sorted(params)}"
            )
        kv = params["sim_kv"]
        return SimPull(str(kv["producer"]), int(kv["num_tokens"]), int(kv["num_bytes"]))

    def consumer_request_params(self, pull: KVPull) -> dict[str, Any]:
        if not isinstance(pull, SimPull):
            raise TypeError(f"sim backend got a {type(pull).__name__}")
        kv = {
            "producer": pull.producer_id,
            "num_tokens": pull.num_tokens,
            "num_bytes": pull.num_bytes,
        }
        return {"do_remote_prefill": True, "sim_kv": kv}
