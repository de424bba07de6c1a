"""Which prefill and which decode replica serve a request. Pure: replica snapshots in, a choice
with its reason out; the router shell gathers the snapshots and acts on the choice.

Prefill: prefix affinity first (the replica that holds the longest cached prefix skips that
much compute), unless it is busier than the least-loaded healthy replica by more than
`max_imbalance_tokens` (a hot prefix must not pile every request onto one replica); then the
fewest pending prefill tokens, then the fewest sequences in the engine. Loads come once a
second and short prompts are prefilled by then, so pending tokens are mostly 0 on every
replica; tied on them alone, the replica of the smallest id took most requests while it
decoded others (two colocated engines, two streams of unique prompts: their workers computed
8.1 and 2.6 cpu-s; with the sequences, 5.8 and 5.4).

Decode: the healthy replica with the most free KV blocks among those that fit the request, then
the fewest running sequences. When none fits, the result says whether waiting can help
(`NO_ROOM_NOW`: queue) or not (`NEVER_FITS`: reject).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from engine.messages import GenerationRequest
from router.pd_decision import PDDecider, PDDecision, PDInputs, PoolSnapshot
from router.prefix import BlockHash, PrefixLookup

# A child of Serve's logger, so decisions land in the Router replica's log at INFO.
decision_logger = logging.getLogger("ray.serve.pdserve.prefill")


@dataclass(frozen=True)
class PrefillReplicaState:
    replica_id: str
    num_pending_prefill_tokens: int
    is_healthy: bool = True
    # Sequences the engine runs or has waiting (a colocated engine's decoding ones too).
    num_seqs: int = 0

    def __post_init__(self) -> None:
        if self.num_pending_prefill_tokens < 0 or self.num_seqs < 0:
            raise ValueError(
                f"num_pending_prefill_tokens and num_seqs must be >= 0 ({self.replica_id})"
            )


@dataclass(frozen=True)
class DecodeReplicaState:
    replica_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    is_healthy: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.num_free_blocks <= self.num_total_blocks:
            raise ValueError(
                f"need 0 <= num_free_blocks <= num_total_blocks ({self.replica_id}), "
                f"got {self.num_free_blocks} of {self.num_total_blocks}"
            )
        if self.num_running_seqs < 0 or self.num_waiting_seqs < 0:
            raise ValueError(f"sequence counts must be >= 0 ({self.replica_id})")


@dataclass(frozen=True)
class PrefillPolicyConfig:
    # A shorter match saves too little compute to be worth steering for.
    min_match_blocks: int = 1
    # How many more pending prefill tokens than the least-loaded healthy replica the affine
    # replica may have and still be chosen.
    max_imbalance_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {self.min_match_blocks}")
        if self.max_imbalance_tokens < 0:
            raise ValueError(f"max_imbalance_tokens must be >= 0, got {self.max_imbalance_tokens}")


class PrefillReason(StrEnum):
    PREFIX_AFFINITY = "prefix_affinity"
    LEAST_PENDING = "least_pending"
    NO_HEALTHY_REPLICA = "no_healthy_replica"


class DecodeReason(StrEnum):
    MOST_FREE_BLOCKS = "most_free_blocks"
    # Some healthy replica could hold the request once blocks free up: queue it.
    NO_ROOM_NOW = "no_room_now"
    # No healthy replica has that many blocks in total: waiting cannot help, reject.
    NEVER_FITS = "never_fits"
    NO_HEALTHY_REPLICA = "no_healthy_replica"


@dataclass(frozen=True)
class PrefillChoice:
    replica_id: str | None
    reason: PrefillReason
    # Blocks of the prompt the chosen replica is expected to hold already.
    num_cached_blocks: int = 0

    @property
    def is_chosen(self) -> bool:
        return self.replica_id is not None


@dataclass(frozen=True)
class DecodeChoice:
    replica_id: str | None
    reason: DecodeReason

    @property
    def is_chosen(self) -> bool:
        return self.replica_id is not None


def choose_prefill_replica(
    replicas: Sequence[PrefillReplicaState],
    prompt_hashes: Sequence[BlockHash],
    index: PrefixLookup,
    config: PrefillPolicyConfig | None = None,
) -> PrefillChoice:
    config = config or PrefillPolicyConfig()
    healthy = {r.replica_id: r for r in replicas if r.is_healthy}
    if not healthy:
        return PrefillChoice(None, PrefillReason.NO_HEALTHY_REPLICA)
    # Ties go to the smaller id, so every router replica makes the same choice.
    least = min(
        healthy.values(), key=lambda r: (r.num_pending_prefill_tokens, r.num_seqs, r.replica_id)
    )
    match = index.longest_prefix_match(prompt_hashes, eligible=healthy.keys())
    if match.replica is not None and match.num_blocks >= config.min_match_blocks:
        affine = healthy[match.replica]
        excess = affine.num_pending_prefill_tokens - least.num_pending_prefill_tokens
        if excess <= config.max_imbalance_tokens:
            return PrefillChoice(affine.replica_id, PrefillReason.PREFIX_AFFINITY, match.num_blocks)
    return PrefillChoice(least.replica_id, PrefillReason.LEAST_PENDING)


def choose_decode_replica(
    replicas: Sequence[DecodeReplicaState], num_blocks_needed: int
) -> DecodeChoice:
    """`num_blocks_needed`: the KV blocks the request needs on arrival (its prompt plus the
    first token, or more to reserve room to grow; see kv_transfer.blocks.num_blocks_for)."""
    if num_blocks_needed < 1:
        raise ValueError(f"num_blocks_needed must be >= 1, got {num_blocks_needed}")
    healthy = [r for r in replicas if r.is_healthy]
    if not healthy:
        return DecodeChoice(None, DecodeReason.NO_HEALTHY_REPLICA)
    fitting = [r for r in healthy if r.num_free_blocks >= num_blocks_needed]
    if not fitting:
        if any(r.num_total_blocks >= num_blocks_needed for r in healthy):
            return DecodeChoice(None, DecodeReason.NO_ROOM_NOW)
        return DecodeChoice(None, DecodeReason.NEVER_FITS)
    best = min(
        fitting,
        key=lambda r: (-r.num_free_blocks, r.num_running_seqs, r.num_waiting_seqs, r.replica_id),
    )
    return DecodeChoice(best.replica_id, DecodeReason.MOST_FREE_BLOCKS)


class PrefillPlacement(Protocol):
    """The router's choice for a new request: True prefills it on its decode replica."""

    def decide(self, request: GenerationRequest) -> bool: ...


class LocalPrefill:
    """Where a new request is prefilled: on a decode replica itself ("local", no KV transfer)
    when its prompt is at most `max_tokens` tokens, else on the prefill pool ("remote"). Short
    prompts cost less to compute than to hand over (Dynamo's conditional disaggregation and
    llm-d's decider use such a threshold on uncached tokens). `on_decision(path)` counts each
    choice. 0 turns local prefill off."""

    def __init__(self, max_tokens: int, on_decision: Callable[[str], None] | None = None) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._on_decision = on_decision

    def decide(self, request: GenerationRequest) -> bool:
        local = request.num_prompt_tokens <= self.max_tokens
        if self._on_decision is not None:
            self._on_decision("local" if local else "remote")
        return local


class PoolLoads(Protocol):
    """The pools' last reported loads (router/pool_view.py)."""

    def prefill(self, prompt_token_ids: Sequence[int]) -> tuple[PoolSnapshot | None, int]: ...

    def serves_none(self, role: str) -> bool: ...

    def decode(self) -> PoolSnapshot | None: ...


class PredictedPrefill:
    """`router.adaptive_prefill`: where each new request is prefilled, by the predicted-TTFT
    decision of router/pd_decision.py on the pools' loads in `pools`. `on_decision(path)`
    counts each choice; each is logged with its inputs (at INFO when its reason changes, else
    at DEBUG); `observe` feeds the decider each finished request."""

    def __init__(
        self,
        decider: PDDecider,
        pools: PoolLoads,
        on_decision: Callable[[str], None] | None = None,
    ) -> None:
        self.decider = decider
        self._pools = pools
        self._on_decision = on_decision
        self.last: PDDecision | None = None

    def decide(self, request: GenerationRequest) -> bool:
        prefill, cached = self._pools.prefill(request.prompt_token_ids)
        inputs = PDInputs(
            request.num_prompt_tokens,
            cached,
            prefill,
            self._pools.decode(),
            no_prefill_engine=self._pools.serves_none("prefill"),
        )
        decision = self.decider.decide(inputs)
        changed = self.last is None or self.last.reason != decision.reason
        decision_logger.log(
            logging.INFO if changed else logging.DEBUG,
            "prefill of %s (%d tokens, %d cached on the prefill side): %s; inputs %s",
            request.request_id,
            request.num_prompt_tokens,
            cached,
            decision.describe(),
            inputs,
        )
        self.last = decision
        if self._on_decision is not None:
            self._on_decision(decision.path)
        return decision.path == "local"
