"""Ray Serve request routers for the engine pools: the pure policies of `router.policy` applied
to the load each replica reports through `record_routing_stats`.

Serve calls `choose_replicas` for each pending handle call and tries the ranks in order, so the
policy's choice comes first and the rest follow as fallbacks (a replica at its
`max_ongoing_requests` refuses and the next rank is tried).

Prefill: prefix affinity through the prefix index (Redis when the app has a control plane, so
every router replica shares it, each lookup bounded to 50 ms behind a circuit breaker; this
router's own records otherwise), then least pending prefill tokens.
Decode: most free KV blocks among replicas that fit the request, then fewest running.
Both add to a replica's last report what this router sent it since (router/sent.py): loads come
once a second, and a burst would otherwise go to one replica.
Both rank only the replicas that take the call's role now (router/roles.py: role flips), and
skip a replica whose engine died (its load says `is_healthy: false`) and those a moved
request already failed on (the call's `avoid` keyword, router/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from control.breaker import CircuitBreaker
from control.keys import POOLS
from control.store import ControlStore
from engine.messages import GenerationRequest, ReplicaLoad
from kv_transfer.blocks import num_blocks_for
from prefill_workers.replica import unique_id_of

# Through the module: Serve pickles this module by value into each handle's router, which
# would give every copy a view of its own (router/pool_view.py).
from router import pool_view
from router.policy import (
    DecodeReplicaState,
    PrefillReplicaState,
    choose_decode_replica,
    choose_prefill_replica,
)
from router.prefix import BlockHash, MatchResult, PrefixIndex, block_hashes, match_owners
from router.roles import ROLE_OF_METHOD
from router.sent import SentSinceReport

logger = logging.getLogger(__name__)


def _request_of(pending: PendingRequest | None) -> GenerationRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, GenerationRequest) else None


def _load_of(replica: RunningReplica) -> ReplicaLoad | None:
    """What the replica last reported; None before its first report, or when it is garbled
    (then it is routed to only as a fallback, like one that has not reported)."""
    try:
        return ReplicaLoad.from_stats(replica.routing_stats)
    except (TypeError, ValueError) as exc:
        logger.debug("ignoring the routing stats of %s: %s", replica.replica_id, exc)
        return None


def _avoided(pending: PendingRequest | None) -> set[str]:
    """The Serve unique ids of the replicas this request already failed on (router/pools.py
    passes their worker ids as the call's `avoid` keyword)."""
    if pending is None:
        return set()
    return {unique_id_of(worker) for worker in pending.kwargs.get("avoid", ())}


def _loads(replicas: Sequence[RunningReplica]) -> dict[str, ReplicaLoad | None]:
    """Each replica's last report, read once per routing decision."""
    return {r.replica_id.unique_id: _load_of(r) for r in replicas}


def _usable(
    replicas: list[RunningReplica],
    loads: dict[str, ReplicaLoad | None],
    pending: PendingRequest | None,
) -> list[RunningReplica]:
    """The replicas worth a call: not reported dead (`ReplicaLoad.is_healthy`: the engine
    died; Serve replaces the replica within its health checks) and not already failed by this
    request. All of them when that leaves none: then the call's own error says why."""
    avoided = _avoided(pending)
    usable = [
        r
        for r in replicas
        if r.replica_id.unique_id not in avoided
        and ((load := loads[r.replica_id.unique_id]) is None or load.is_healthy)
    ]
    return usable or replicas


def _serving_role(
    replicas: list[RunningReplica],
    loads: dict[str, ReplicaLoad | None],
    pending: PendingRequest | None,
) -> list[RunningReplica]:
    """The replicas that take this call's role now (router/roles.py: a flipped replica takes
    the other pool's calls), by the worker id each reported; one that has not reported yet
    counts as serving. All of them when that leaves none: every engine can take every call."""
    role = ROLE_OF_METHOD.get(pending.metadata.call_method) if pending is not None else None
    if role is None:
        return replicas
    table = pool_view.POOL_VIEW.roles
    serving = [
        r
        for r in replicas
        if (load := loads[r.replica_id.unique_id]) is None or table.role_of(load.replica_id) == role
    ]
    return serving or replicas


def _ranked(replicas: Sequence[RunningReplica], chosen: str | None) -> list[list[RunningReplica]]:
    first = [r for r in replicas if r.replica_id.unique_id == chosen]
    rest = [r for r in replicas if r.replica_id.unique_id != chosen]
    return [first, rest] if first else [rest]


class _FixedMatch:
    """A PrefixLookup that answers with a match already fetched (from Redis, asynchronously)."""

    def __init__(self, match: MatchResult) -> None:
        self._match = match

    def longest_prefix_match(
        self, hashes: Sequence[BlockHash], eligible: Collection[str] | None = None
    ) -> MatchResult:
        return self._match

    def record(self, hashes: Sequence[BlockHash], replica: str) -> None:
        raise NotImplementedError


# The prefix index in Redis is advisory: a lookup waits this long at most, and a record this long.
LOOKUP_TIMEOUT_S = 0.05
RECORD_TIMEOUT_S = 1.0


class SharedPrefixIndex:
    """The prefix index in Redis as routing uses it, never slow: each lookup is bounded to
    `timeout_s` (50 ms), and after failures in a row a circuit breaker skips Redis for a while
    (one trial call then decides). Records are fire-and-forget, bounded too, and skipped while
    the breaker is open. `owners` answers None when Redis cannot: route on what this router
    knows (its own records) instead."""

    def __init__(
        self,
        store: ControlStore,
        timeout_s: float = LOOKUP_TIMEOUT_S,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._pending: set[asyncio.Future[Any]] = set()

    async def owners(self, hashes: Sequence[BlockHash]) -> list[str | None] | None:
        if not self.breaker.allow():
            return None
        try:
            owners = await asyncio.wait_for(self._store.prefix_owners(hashes), self._timeout_s)
        except Exception as exc:  # a timeout, a refused connection, a restart in progress
            was_open = self.breaker.is_open
            self.breaker.failed()
            if self.breaker.is_open and not was_open:
                logger.warning(
                    "prefix index lookups in Redis failing (%s: %s); routing on this router's "
                    "own records until a trial lookup succeeds",
                    type(exc).__name__,
                    exc,
                )
            return None
        if self.breaker.is_open:
            logger.warning("prefix index lookups in Redis work again")
        self.breaker.succeeded()
        return owners

    def record(self, hashes: Sequence[BlockHash], replica: str, ttl_s: float) -> None:
        if self.breaker.is_open:
            return
        task = asyncio.ensure_future(
            asyncio.wait_for(self._store.record_prefix(hashes, replica, ttl_s), RECORD_TIMEOUT_S)
        )
        self._pending.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._recorded)

    def _recorded(self, task: asyncio.Future[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("recording prefix blocks in Redis failed: %s", task.exception())


class EngineRequestRouter(RequestRouter):
    """Routes the calls of one engine pool's handle by the role each call serves: a prefill
    call by prefix affinity, then least pending tokens, then fewest sequences; a decode or
    generate call by most free KV blocks among the replicas that fit it, then fewest running.
    After a role flip a pool's handle takes the other pool's calls (router/roles.py), so each
    pool routes both kinds."""

    pool: ClassVar[str]

    def initialize_state(
        self,
        block_size: int = 32,
        prefix_ttl_s: float = 300.0,
        redis_url: str | None = None,
        redis_url_env: str | None = None,
        app_name: str = "pdserve",
        **_: Any,
    ) -> None:
        """`redis_url_env` names the variable that holds the control plane's URL (it carries a
        password, and Serve's REST API returns these kwargs); `redis_url` is the URL itself."""
        self._block_size = block_size
        self._prefix_ttl_s = prefix_ttl_s
        self._local_index = PrefixIndex(ttl_seconds=prefix_ttl_s)
        # Prompt tokens and KV blocks sent since each replica's last load report (router/sent.py).
        self._sent_tokens = SentSinceReport()
        self._sent_blocks = SentSinceReport()
        if self.pool == "prefill":
            pool_view.POOL_VIEW.use_prefix_index(self._local_index, block_size)
        if redis_url is None and redis_url_env:
            redis_url = os.environ.get(redis_url_env)
            if not redis_url:
                logger.warning(
                    "$%s is not set in this process: the prefix index is this router's own "
                    "(set it in the environment of `ray start` on every node)",
                    redis_url_env,
                )
        store = ControlStore.from_url(redis_url, app_name) if redis_url else None
        self._shared = SharedPrefixIndex(store) if store is not None else None

    def _role_of(self, pending: PendingRequest | None) -> str:
        """The role whose policy ranks this call (a call of no role: this pool's own)."""
        method = pending.metadata.call_method if pending is not None else ""
        return ROLE_OF_METHOD.get(method, self.pool)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request_of(pending_request)
        loads = _loads(candidate_replicas)
        pool_view.POOL_VIEW.update(self.pool, loads.values())
        candidate_replicas = _usable(candidate_replicas, loads, pending_request)
        if self.pool in POOLS:
            candidate_replicas = _serving_role(candidate_replicas, loads, pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        if self._role_of(pending_request) == "prefill":
            return await self._choose_prefill(request, candidate_replicas, loads)
        return self._choose_decode(request, candidate_replicas, loads)

    async def _choose_prefill(
        self,
        request: GenerationRequest,
        candidate_replicas: list[RunningReplica],
        loads: dict[str, ReplicaLoad | None],
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        states = []
        for rid in by_id:
            load = loads[rid]
            tokens, calls = self._sent_tokens.since(rid, load.updated_at if load else None)
            states.append(
                PrefillReplicaState(
                    replica_id=rid,
                    num_pending_prefill_tokens=tokens
                    + (load.num_pending_prefill_tokens if load else 0),
                    num_seqs=calls + (load.num_running + load.num_waiting if load else 0),
                )
            )
        hashes = block_hashes(request.prompt_token_ids, self._block_size)
        choice = choose_prefill_replica(states, hashes, await self._lookup(hashes, by_id.keys()))
        if choice.replica_id is not None:
            self._sent_tokens.record(choice.replica_id, request.num_prompt_tokens)
            if hashes:
                await self._record(hashes, choice.replica_id)
        return _ranked(candidate_replicas, choice.replica_id)

    async def _lookup(self, hashes: Sequence[BlockHash], eligible: Collection[str]) -> Any:
        owners = await self._shared.owners(hashes) if self._shared and hashes else None
        if owners is None:  # no control plane, or it cannot answer now: this router's records
            return self._local_index
        return _FixedMatch(match_owners(owners, set(eligible)))

    async def _record(self, hashes: Sequence[BlockHash], replica: str) -> None:
        self._local_index.record(hashes, replica)
        if self._shared is not None:
            self._shared.record(hashes, replica, self._prefix_ttl_s)

    def _choose_decode(
        self,
        request: GenerationRequest,
        candidate_replicas: list[RunningReplica],
        loads: dict[str, ReplicaLoad | None],
    ) -> list[list[RunningReplica]]:
        reported = [
            (r, load)
            for r in candidate_replicas
            if (load := loads[r.replica_id.unique_id]) is not None and load.num_total_blocks
        ]
        if not reported:
            return [candidate_replicas]
        states = []
        for replica, load in reported:
            rid = replica.replica_id.unique_id
            blocks, calls = self._sent_blocks.since(rid, load.updated_at)
            free = min(load.num_total_blocks, load.num_free_blocks)
            states.append(
                DecodeReplicaState(
                    replica_id=rid,
                    num_free_blocks=max(0, free - blocks),
                    num_total_blocks=load.num_total_blocks,
                    num_running_seqs=load.num_running + calls,
                    num_waiting_seqs=load.num_waiting,
                )
            )
        needed = num_blocks_for(request.num_prompt_tokens + 1, self._block_size)
        choice = choose_decode_replica(states, needed)
        if choice.replica_id is not None:
            self._sent_blocks.record(choice.replica_id, needed)
        return _ranked(candidate_replicas, choice.replica_id)


class PrefillRequestRouter(EngineRequestRouter):
    pool = "prefill"


class DecodeRequestRouter(EngineRequestRouter):
    pool = "decode"


class ColocatedRequestRouter(EngineRequestRouter):
    """The colocated pool: every call is a whole request, routed as a prefill (prefix
    affinity, then least pending tokens, then fewest sequences); no roles."""

    pool = "engine"

    def _role_of(self, pending: PendingRequest | None) -> str:
        return "prefill"
