"""What the scheduler side of RayKVConnector tells its worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kv_transfer.ray_params import RayKVHandoff


@dataclass(frozen=True)
class SaveRequest:
    """Producer: the prompt of `request_id` is fully computed after this step; store it."""

    request_id: str
    key: str
    block_ids: tuple[int, ...]  # the request's blocks covering its prompt, in order
    num_tokens: int
    prompt_digest: str


@dataclass(frozen=True)
class LoadRequest:
    """Consumer: pull producer blocks [first_block, first_block + len(block_ids)) into block_ids.

    `refusal` set means the scheduler already knows this KV must not be used; the worker only
    reports the failure, so vLLM's kv_load_failure_policy decides what happens next.
    """

    request_id: str
    handoff: RayKVHandoff | None
    block_ids: tuple[int, ...] = ()
    first_block: int = 0
    refusal: str | None = None


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
