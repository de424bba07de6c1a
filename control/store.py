"""`ControlStore`: the control plane's async face, on `redis.asyncio`, around keys.py and
records.py. What replicas and routers read and write while serving; the operator's settings and
the decision log are the sync face's (sync_store.py).

Who calls what, and how often:

    replicas     put_replica_load        every report tick, per replica (via LoadPublisher)
    routers      record_prefix           per prefill, after it is routed
                 prefix_owners           per request (one MGET)
                 record_sample           per finished request and metric
    status       replica_loads, recent_samples                         per `pdserve status`

Every value is a short JSON or text string; no KV-cache data ever goes through Redis.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from control.keys import ControlKeys, validate_metric
from control.records import decode_replica_load, encode_replica_load
from engine.messages import ReplicaLoad

DEFAULT_SAMPLE_CAP = 2048


class ControlStore:
    """One app's view of the control plane. Owns `client`: `close()` closes it."""

    def __init__(self, client: aioredis.Redis, app: str) -> None:
        self._client = client
        self.keys = ControlKeys(app)

    @classmethod
    def from_url(cls, url: str, app: str) -> ControlStore:
        """No I/O yet: the first command connects."""
        return cls(aioredis.Redis.from_url(url), app)

    @classmethod
    async def connect(cls, url: str, app: str) -> ControlStore:
        """Connect and PING, so a wrong URL or password fails here, not on first use."""
        store = cls.from_url(url, app)
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

    # Replica status: one hash per pool, one field per replica, its last reported load.

    async def put_replica_load(self, load: ReplicaLoad) -> None:
        await self._client.hset(
            self.keys.replicas(load.pool), load.replica_id, encode_replica_load(load)
        )

    async def replica_loads(self, pool: str, max_age_s: float = 30.0) -> list[ReplicaLoad]:
        """Loads reported within `max_age_s` (wall clock), sorted by replica id. A replica that
        died just goes stale; its field stays in the hash."""
        raw: dict[bytes | str, bytes | str] = await self._client.hgetall(self.keys.replicas(pool))
        now = time.time()
        loads = [decode_replica_load(value) for value in raw.values()]
        fresh = [load for load in loads if load.is_fresh(now, max_age_s)]
        return sorted(fresh, key=lambda load: load.replica_id)

    # Prefix index: block hash -> the prefill replica that last computed it, with a TTL. The
    # matching rule is the router's (`router.prefix.match_owners`); here are keys and values.

    async def record_prefix(self, hashes: Sequence[bytes], replica: str, ttl_s: float) -> None:
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

    async def prefix_owners(self, hashes: Sequence[bytes]) -> list[str | None]:
        """The live owner of each block, in order; None where unknown or expired."""
        if not hashes:
            return []
        values = await self._client.mget([self.keys.prefix(h) for h in hashes])
        return [None if value is None else _text(value) for value in values]

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


class LoadPublisher:
    """How a replica publishes its load: `build_app` puts one in each scaled pool's settings
    (the replica packages sit below control/ and do not import it). Picklable, since Serve
    passes it to the replica: it carries the URL, and connects there on first use."""

    def __init__(self, url: str, app: str) -> None:
        self.url = url
        self.app = ControlKeys(app).app
        self._store: ControlStore | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoadPublisher, (self.url, self.app))

    def __repr__(self) -> str:  # never the URL: it carries the password
        return f"LoadPublisher(app={self.app!r})"

    async def publish(self, load: ReplicaLoad) -> None:
        if self._store is None:
            self._store = ControlStore.from_url(self.url, self.app)
        await self._store.put_replica_load(load)


def _text(value: bytes | str) -> str:
    """Redis values arrive as bytes, or as str on a client made with decode_responses=True."""
    return value.decode() if isinstance(value, bytes) else value


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
