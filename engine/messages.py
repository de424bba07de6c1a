"""Every record that crosses a process boundary, in one place; frozen, picklable, no behaviour
beyond checking itself.

    router ──GenerationRequest──> prefill replica ──PrefillResult (first token, KVHandoff)──> router
    router ──GenerationRequest, KVHandoff──> decode replica ──TokenEvent stream──> router
    router <──TokenEvent stream── colocated replica (no handoff)
    engine replica ──ReplicaLoad──> request routers (Serve's routing stats), `pdserve status`

`KVHandoff` is what a decode worker needs to pull one request's KV cache from a prefill worker.
Its backend-specific part (`pull`) is typed per backend; `digest` covers the whole record so a
handoff altered on its way is refused, and `layout` lets the consumer refuse a producer whose KV
it cannot read. The first token lives in the handoff only: decode checks that it re-samples it.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.params import GenerationParams


class KVHandshakeError(ValueError):
    """Producer and consumer disagree on what the KV cache is; nothing is transferred."""


class KVTransferError(RuntimeError):
    """A KV transfer failed (lease expired, object missing, checksum mismatch)."""


class EngineRefused(ValueError):
    """The engine refused the request itself (vLLM's client errors, e.g. a structured-output
    constraint it cannot compile): the request's fault, not the replica's, so it is not moved."""


class ReplicaFailure(RuntimeError):
    """An engine replica failed a request for a reason of its own (its engine died, a transfer
    broke; not the request's fault, which stays a ValueError). It names the replica, so the
    router moves the request and avoids that replica, even when the replica failed before its
    first answer (Ray re-raises it with its attributes)."""

    def __init__(self, replica_id: str, message: str) -> None:
        super().__init__(replica_id, message)
        self.replica_id = replica_id

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.args[1]}"


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request as the pools see it: token ids in, parameters validated."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: GenerationParams

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_pinned_seed(self) -> GenerationRequest:
        """Sampled requests get a seed, so prefill and decode draw the same random stream and
        the token decode continues from is the token prefill streamed."""
        if self.params.is_greedy or self.params.seed is not None:
            return self
        params = replace(self.params, seed=secrets.randbits(63))
        return replace(self, params=params)


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

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds: K and V, every layer and KV head."""
        item = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

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
class SimPull:
    """The `sim` backend's record: what a simulated producer computed, so the consumer can
    model the transfer's time from its bytes (engine/sim/)."""

    producer_id: str
    num_tokens: int
    num_bytes: int


KVPull = NixlPull | RayPull | SimPull


@dataclass(frozen=True)
class KVHandoff:
    backend: str
    producer_id: str
    request_id: str
    num_prompt_tokens: int
    first_token: int
    layout: KVLayout
    lease_expires_at: float
    pull: KVPull
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


# One sampled token's log-probabilities: (token id, logprob) pairs, the sampled token first, then
# the most likely tokens by rank (as many as the request asked for).
TokenLogprobs = tuple[tuple[int, float], ...]


def token_logprobs(sampled: int, candidates: Mapping[int, Any], top: int) -> TokenLogprobs:
    """vLLM's per-token dict (token id -> Logprob with .logprob and .rank: the `top` most
    likely tokens, and the sampled one whatever its rank) as TokenLogprobs: the sampled token,
    then the `top` most likely by rank (the sampled one among them when it ranks there)."""
    ranked = sorted(candidates.items(), key=lambda item: item[1].rank or 0)
    top_pairs = [(int(t), float(lp.logprob)) for t, lp in ranked if (lp.rank or 0) <= top]
    return ((sampled, float(candidates[sampled].logprob)), *top_pairs)


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns. Whoever receives it owns the handoff's lease: it must go
    to a decode worker's `decode` or `release`."""

    handoff: KVHandoff
    # Set when the first token already ends the request (stop token, or max_tokens == 1).
    finish_reason: str | None
    # Engine compute time (scheduled -> first token) when vLLM reports it, else the wall time
    # of the engine call.
    prefill_seconds: float
    # Time the request waited in the engine's queue before it was scheduled.
    engine_queue_seconds: float = 0.0
    # The first token's log-probabilities, when the request asked for them.
    first_logprobs: TokenLogprobs | None = None

    @property
    def first_token(self) -> int:
        return self.handoff.first_token


@dataclass(frozen=True)
class TokenEvent:
    """What an engine stream hands the router: tokens, and the timings only the engine knows."""

    token_ids: tuple[int, ...]
    finish_reason: str | None
    # The first token, streamed as soon as prefill is done (TTFT ends here).
    is_first: bool = False
    # On the first event: engine compute for the prompt.
    prefill_seconds: float = 0.0
    # An empty event sent just before the decode pool is called (disaggregated only).
    is_decode_start: bool = False
    # The engine replica (worker id) that produced these tokens: set on the first event of each
    # phase (prefill's first token; decode's first event), so timings can say who served.
    replica_id: str = ""
    # One entry per token of `token_ids` when the request asked for log-probabilities.
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class ReplicaLoad:
    """One engine replica's load, as it reports it: to its pool's request router through
    Serve's routing stats (a dict: `to_stats` / `from_stats` at the two ends), and to the
    control plane for `pdserve status`. `updated_at` is unix seconds."""

    replica_id: str
    pool: str
    num_pending_prefill_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_total_blocks: int
    num_free_blocks: int
    updated_at: float
    # A consumer's KV loads since it started: all of them, the failed ones (the engine computed
    # the prompt itself, or refused it), and the prompt tokens it recomputed (engine/stats.py).
    num_kv_loads: int = 0
    num_kv_load_failures: int = 0
    num_kv_recomputed_tokens: int = 0
    # False once the replica's engine has died: the request routers send it nothing more, and
    # Serve's health check replaces the replica.
    is_healthy: bool = True

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must be non-empty")
        if not self.pool:
            raise ValueError("pool must be non-empty")
        for name in (
            "num_pending_prefill_tokens",
            "num_running",
            "num_waiting",
            "num_total_blocks",
            "num_free_blocks",
            "num_kv_loads",
            "num_kv_load_failures",
            "num_kv_recomputed_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if not math.isfinite(self.updated_at) or self.updated_at < 0:
            raise ValueError(f"updated_at must be a finite unix time >= 0, got {self.updated_at}")

    def is_fresh(self, now: float, max_age_s: float) -> bool:
        """Reported within `max_age_s` of `now`; a clock slightly ahead still counts as fresh."""
        return now - self.updated_at <= max_age_s

    def to_stats(self) -> dict[str, Any]:
        """What `record_routing_stats` returns (Serve wants a dict)."""
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> ReplicaLoad | None:
        """The load a request router sees; None before the replica's first report (Serve
        starts every replica with empty stats). ValueError names a missing field."""
        if not stats:
            return None
        missing = [f.name for f in fields(cls) if f.name not in stats]
        if missing:
            raise ValueError(f"routing stats lack {', '.join(missing)}")
        return cls(**{f.name: stats[f.name] for f in fields(cls)})
