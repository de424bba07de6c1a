"""`ControlStore`: the async Redis shell around keys.py and records.py.

Who calls what, and how often:

    replicas     put_replica_status      every report tick, per replica
    routers      replica_statuses        per routing decision or refresh
                 record_prefix           per prefill, after it finishes
                 longest_prefix_match    per request (one MGET)
    replicas     record_sample           per finished request and metric
    autoscaler   recent_samples, get_slo, get_bounds, get_pin, append_decision    per tick
    CLI          set_slo, set_bounds, set_pin, clear_pin, recent_decisions

Every value is a short JSON or text string; no KV-cache data ever goes through Redis.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence

import redis.asyncio as aioredis

from autoscaling.config import PoolSLO, ReplicaBounds
from control.keys import ControlKeys, validate_metric, validate_pool
from control.records import (
    DecisionRecord,
    ReplicaStatus,
    decode_bounds,
    decode_decision,
    decode_pin,
    decode_replica_status,
    decode_slo,
    encode_bounds,
    encode_decision,
    encode_pin,
    encode_replica_status,
    encode_slo,
)
from router.prefix import BlockHash, MatchResult, match_owners

DEFAULT_SAMPLE_CAP = 2048
DEFAULT_DECISION_CAP = 1000


class ControlStore:
    """One app's view of the control plane. Owns `client`: `close()` closes it."""

    def __init__(self, client: aioredis.Redis, app: str) -> None:
        self._client = client
        self.keys = ControlKeys(app)

    @classmethod
    async def connect(cls, url: str, app: str) -> ControlStore:
        """Connect and PING, so a wrong URL or password fails here, not on first use."""
        store = cls(aioredis.Redis.from_url(url), app)
        try:
            await store.ping()
        except BaseException:
            await store.close()
            raise
        return store

    @property
    def app(self) -> str:
        return self.keys.app

    async def ping(self) -> bool:
        return bool(await self._client.ping())

    async def close(self) -> None:
        await self._client.aclose()

    # Replica status: one hash per pool, one field per replica.

    async def put_replica_status(self, pool: str, status: ReplicaStatus) -> None:
        if status.pool != validate_pool(pool):
            raise ValueError(f"status of a {status.pool} replica put under pool {pool!r}")
        await self._client.hset(
            self.keys.replicas(pool), status.replica_id, encode_replica_status(status)
        )

    async def replica_statuses(self, pool: str, max_age_s: float = 30.0) -> list[ReplicaStatus]:
        """Statuses reported within `max_age_s` (wall clock), sorted by replica id. A replica
        that died without `remove_replica` just goes stale; its field stays until removed."""
        raw: dict[bytes | str, bytes | str] = await self._client.hgetall(self.keys.replicas(pool))
        now = time.time()
        statuses = [decode_replica_status(value) for value in raw.values()]
        fresh = [status for status in statuses if status.is_fresh(now, max_age_s)]
        return sorted(fresh, key=lambda status: status.replica_id)

    async def remove_replica(self, pool: str, replica_id: str) -> None:
        await self._client.hdel(self.keys.replicas(pool), replica_id)

    # Prefix index: block hash -> the prefill replica that last computed it, with a TTL.

    async def record_prefix(self, hashes: Sequence[BlockHash], replica: str, ttl_s: float) -> None:
        """`replica` has just computed these blocks; last writer wins, as in `PrefixIndex`."""
        if not replica:
            raise ValueError("replica must be non-empty")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not hashes:
            return
        ttl_ms = max(1, round(ttl_s * 1000))
        async with self._client.pipeline(transaction=False) as pipe:
            for block_hash in hashes:
                pipe.set(self.keys.prefix(block_hash), replica, px=ttl_ms)
            await pipe.execute()

    async def prefix_owners(self, hashes: Sequence[BlockHash]) -> list[str | None]:
        """The live owner of each block, in order; None where unknown or expired."""
        if not hashes:
            return []
        values = await self._client.mget([self.keys.prefix(h) for h in hashes])
        return [None if value is None else _text(value) for value in values]

    async def longest_prefix_match(
        self, hashes: Sequence[BlockHash], eligible: Collection[str] | None = None
    ) -> MatchResult:
        """The async twin of `PrefixIndex.longest_prefix_match`, with the same rule."""
        return match_owners(await self.prefix_owners(hashes), eligible)

    # Latency samples: one capped list per metric, newest first.

    async def record_sample(
        self, metric: str, value_s: float, cap: int = DEFAULT_SAMPLE_CAP
    ) -> None:
        key = self.keys.samples(metric)
        if not math.isfinite(value_s) or value_s < 0:
            raise ValueError(f"a {metric} sample must be a finite number >= 0, got {value_s}")
        _check_count("cap", cap)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.lpush(key, repr(float(value_s)))
            pipe.ltrim(key, 0, cap - 1)
            await pipe.execute()

    async def recent_samples(self, metric: str, n: int = 1000) -> list[float]:
        """Up to `n` samples in seconds, newest first."""
        _check_count("n", n)
        values = await self._client.lrange(self.keys.samples(validate_metric(metric)), 0, n - 1)
        return [float(_text(value)) for value in values]

    # SLO, bounds and pins: set by the CLI, read by the autoscaler every tick.

    async def get_slo(self) -> PoolSLO | None:
        raw = await self._client.get(self.keys.slo)
        return None if raw is None else decode_slo(raw)

    async def set_slo(self, slo: PoolSLO) -> None:
        await self._client.set(self.keys.slo, encode_slo(slo))

    async def get_bounds(self, pool: str) -> ReplicaBounds | None:
        raw = await self._client.get(self.keys.bounds(pool))
        return None if raw is None else decode_bounds(raw)

    async def set_bounds(self, pool: str, bounds: ReplicaBounds) -> None:
        await self._client.set(self.keys.bounds(pool), encode_bounds(bounds))

    async def get_pin(self, pool: str) -> int | None:
        raw = await self._client.get(self.keys.pin(pool))
        return None if raw is None else decode_pin(raw)

    async def set_pin(self, pool: str, num_replicas: int) -> None:
        await self._client.set(self.keys.pin(pool), encode_pin(num_replicas))

    async def clear_pin(self, pool: str) -> None:
        await self._client.delete(self.keys.pin(pool))

    # Decision log: one capped list for both pools, newest first.

    async def append_decision(
        self, record: DecisionRecord, cap: int = DEFAULT_DECISION_CAP
    ) -> None:
        _check_count("cap", cap)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.lpush(self.keys.decisions, encode_decision(record))
            pipe.ltrim(self.keys.decisions, 0, cap - 1)
            await pipe.execute()

    async def recent_decisions(self, pool: str | None = None, n: int = 20) -> list[DecisionRecord]:
        """Up to `n` decisions, newest first, of one pool or of both."""
        _check_count("n", n)
        if pool is None:
            values = await self._client.lrange(self.keys.decisions, 0, n - 1)
            return [decode_decision(value) for value in values]
        validate_pool(pool)
        # Both pools share the list, so read in pages until `n` of this pool are found.
        found: list[DecisionRecord] = []
        page = max(2 * n, 64)
        start = 0
        while len(found) < n:
            values = await self._client.lrange(self.keys.decisions, start, start + page - 1)
            found.extend(r for r in map(decode_decision, values) if r.pool == pool)
            if len(values) < page:
                break
            start += page
        return found[:n]


def _text(value: bytes | str) -> str:
    """Redis values arrive as bytes, or as str on a client made with decode_responses=True."""
    return value.decode() if isinstance(value, bytes) else value


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
