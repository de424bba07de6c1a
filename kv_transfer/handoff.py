"""KVHandoff: what a decode worker needs to pull one request's KV cache from a prefill worker.

A small, frozen, serialisable record. The backend-specific part (`pull`) is typed per backend;
`digest` covers the whole record so a handoff altered on its way is refused, and `layout`
lets the consumer refuse a producer whose KV it cannot read.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, fields
from typing import Any


class KVHandshakeError(ValueError):
    """Producer and consumer disagree on what the KV cache is; nothing is transferred."""


class KVTransferError(RuntimeError):
    """A KV transfer failed (lease expired, object missing, checksum mismatch)."""


@dataclass(frozen=True)
class KVLayout:
    """Everything that must be equal on both ends for KV blocks to mean the same thing."""

    model: str  # served model name
    weights_digest: str  # hash of the weight files: same name, different weights is refused
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def mismatches(self, other: KVLayout) -> list[str]:
        return [
            f"{f.name}: producer {getattr(self, f.name)!r} != consumer {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check_compatible(self, consumer: KVLayout) -> None:
        problems = self.mismatches(consumer)
        if problems:
            raise KVHandshakeError("KV layout mismatch, refusing transfer: " + "; ".join(problems))


@dataclass(frozen=True)
class NixlPull:
    """Where vLLM's NixlConnector on the decode side reads the producer's blocks."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    transfer_mode: str = "pull"

    @classmethod
    def from_producer_params(cls, params: dict[str, Any]) -> NixlPull:
        raw_blocks = params["remote_block_ids"]
        # One list per KV-cache group; older vLLMs send a flat list for a single group.
        groups = raw_blocks if raw_blocks and isinstance(raw_blocks[0], list) else [raw_blocks]
        return cls(
            remote_engine_id=str(params["remote_engine_id"]),
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_block_ids=tuple(tuple(int(b) for b in g) for g in groups),
            remote_num_tokens=int(params.get("remote_num_tokens") or 0),
            tp_size=int(params.get("tp_size") or 1),
            dcp_size=int(params.get("dcp_size") or 1),
            pp_size=int(params.get("pp_size") or 1),
            transfer_mode=str(params.get("transfer_mode") or "pull"),
        )

    def to_consumer_params(self, flat_blocks: bool) -> dict[str, Any]:
        blocks: list[Any] = [list(g) for g in self.remote_block_ids]
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": blocks[0] if flat_blocks else blocks,
            "remote_num_tokens": self.remote_num_tokens,
            "remote_blocks_expiry_time": None,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "transfer_mode": self.transfer_mode,
        }

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.remote_block_ids)


@dataclass(frozen=True)
class RayPull:
    """The `ray` backend's record: the producer connector's parameters, kept whole.

    They are plain JSON values (key, counts, per-request digest, layout) that our own
    connector writes and reads; nothing else interprets them.
    """

    params_json: str

    @classmethod
    def from_producer_params(cls, params: dict[str, Any]) -> RayPull:
        return cls(params_json=json.dumps(params, sort_keys=True))

    @property
    def params(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.params_json)
        return loaded


@dataclass(frozen=True)
class KVHandoff:
    backend: str
    producer_id: str
    request_id: str
    num_prompt_tokens: int
    first_token: int
    layout: KVLayout
    lease_expires_at: float
    pull: NixlPull | RayPull
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", self.compute_digest())

    def compute_digest(self) -> str:
        body = asdict(self)
        body.pop("digest")
        body["pull_type"] = type(self.pull).__name__
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]

    def verify(self, now: float | None = None) -> None:
        """Refuse a handoff that was altered or whose lease has run out."""
        if self.digest != self.compute_digest():
            raise KVTransferError(f"handoff for {self.request_id} fails its digest check")
        now = time.time() if now is None else now
        if now > self.lease_expires_at:
            raise KVTransferError(
                f"lease for {self.request_id} expired {now - self.lease_expires_at:.1f} s ago"
            )
