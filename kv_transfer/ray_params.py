"""The `ray` backend's plain data: its settings and the handoff that travels producer -> consumer.

Pure (no ray, no vllm). Shapes of `kv_transfer_params`:

    producer request   {"do_remote_decode": True, "ray_kv_owner": <owner>}
                       (owner: "<prefill id>/<request id>:<attempt>")
    producer output    {"ray_kv": <RayKVHandoff.to_dict()>}        (None when nothing was stored)
    consumer request   {"do_remote_prefill": True, "ray_kv": <the same dict>}
    consumer output    {"ray_kv_load": "loaded" | "recomputed" | "not_loaded"}

"recomputed": the load failed and vLLM recomputed the prompt (kv_load_failure_policy
"recompute"); "not_loaded": the request finished before any load (aborted) or the consumer's own
prefix cache already held the prompt. Under policy "fail" a failed load ends the request with
finish_reason "error" and vLLM sends no kv_transfer_params.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from kv_transfer.blocks import BlockLayout, num_blocks_for

HANDOFF_PARAM = "ray_kv"
LOAD_STATUS_PARAM = "ray_kv_load"
# Who a stored request's lease belongs to: the prefill worker's id and its attempt id (the
# caller's request id plus a per-attempt suffix; vLLM's own request ids get a random suffix the
# worker never sees). The worker releases by it when it abandons a prefill whose output it
# never received.
OWNER_PARAM = "ray_kv_owner"
LoadStatus = Literal["loaded", "recomputed", "not_loaded"]


@dataclass(frozen=True)
class RayKVSettings:
    """`kv_connector_extra_config` of a RayKVConnector, validated once at engine start."""

    lease_registry: str
    ray_address: str | None = None
    ray_namespace: str | None = None
    # The host address this engine's processes join Ray from (the node's IP).
    node_ip: str | None = None
    lease_seconds: float = 60.0
    # Longest wait for one registry call or one layer's object before the load counts as failed.
    fetch_timeout_s: float = 30.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> RayKVSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"RayKVConnector: unknown kv_connector_extra_config keys {unknown}")
        name = extra.get("lease_registry")
        if not isinstance(name, str) or not name:
            raise ValueError("RayKVConnector needs kv_connector_extra_config['lease_registry']")
        settings = cls(
            lease_registry=name,
            ray_address=extra.get("ray_address") or None,
            ray_namespace=extra.get("ray_namespace") or None,
            node_ip=extra.get("node_ip") or None,
            lease_seconds=float(extra.get("lease_seconds", cls.lease_seconds)),
            fetch_timeout_s=float(extra.get("fetch_timeout_s", cls.fetch_timeout_s)),
        )
        if settings.lease_seconds <= 0 or settings.fetch_timeout_s <= 0:
            raise ValueError("RayKVConnector: lease_seconds and fetch_timeout_s must be positive")
        return settings


def lease_owner_id(producer_id: str, attempt_id: str) -> str:
    """A lease owner (kv_transfer.leases.make_lease_key keys its leases under it)."""
    return f"{producer_id}/{attempt_id}"


@dataclass(frozen=True)
class RayKVHandoff:
    """What a consumer needs to pull one request's KV, and to refuse KV that does not fit."""

    key: str
    producer_id: str
    num_tokens: int
    block_size: int
    num_blocks: int
    expires_at: float
    digest: str
    prompt_digest: str
    layout: BlockLayout

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["layout"] = self.layout.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: object) -> RayKVHandoff:
        if not isinstance(raw, Mapping):
            raise ValueError(f"'{HANDOFF_PARAM}' must be a dict, got {type(raw).__name__}")
        missing = [f.name for f in fields(cls) if f.name not in raw]
        if missing:
            raise ValueError(f"'{HANDOFF_PARAM}' lacks {', '.join(missing)}")
        try:
            handoff = cls(
                key=str(raw["key"]),
                producer_id=str(raw["producer_id"]),
                num_tokens=int(raw["num_tokens"]),
                block_size=int(raw["block_size"]),
                num_blocks=int(raw["num_blocks"]),
                expires_at=float(raw["expires_at"]),
                digest=str(raw["digest"]),
                prompt_digest=str(raw["prompt_digest"]),
                layout=BlockLayout.from_dict(raw["layout"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed '{HANDOFF_PARAM}': {exc}") from exc
        if handoff.num_tokens < 1 or handoff.num_blocks != num_blocks_for(
            handoff.num_tokens, handoff.block_size
        ):
            raise ValueError(
                f"'{HANDOFF_PARAM}' claims {handoff.num_blocks} blocks of {handoff.block_size} "
                f"for {handoff.num_tokens} tokens"
            )
        return handoff

    def with_expiry(self, expires_at: float) -> RayKVHandoff:
        return replace(self, expires_at=expires_at)


def consumer_params(producer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer's `kv_transfer_params` from the producer's output `kv_transfer_params`."""
    return {"do_remote_prefill": True, HANDOFF_PARAM: producer_params.get(HANDOFF_PARAM)}
