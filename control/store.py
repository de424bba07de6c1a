"""`ControlStore`: the control plane's async face, on `redis.asyncio`, around keys.py and
records.py. What replicas and routers read and write while serving; the operator's settings and
the decision log are the sync face's (sync_store.py).

Who calls what, and how often:

    replicas     put_replica_load        every report tick, per replica (via LoadPublisher)
    routers      record_prefix           per prefill, after it is routed
                 prefix_owners           per request (one MGET)
                 record_sample           per finished request and metric
                 acquire_key_slot        per request of an API key with limits (one script)
                 refresh_key_slots       every lease/3 while such requests stream
                 release_key_slot        per such request, when it ends
    status       replica_loads, recent_samples                         per `pdserve status`

Every value is a short JSON or text string; no KV-cache data ever goes through Redis.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from control.breaker import BestEffort
from control.keys import ControlKeys, validate_metric
from control.records import (
    RolesApplied,
    RoleTable,
    decode_replica_load,
    encode_replica_load,
    encode_roles_applied,
)
from engine.messages import ReplicaLoad

DEFAULT_SAMPLE_CAP = 2048
# A connection that cannot be made in this long fails the call (a host that does not answer).
CONNECT_TIMEOUT_S = 1.0
# A command's reply: every one is a short string, so only a Redis that hangs takes this long.
REPLY_TIMEOUT_S = 5.0


# An API key's limits, atomically, on Redis's own clock (routers' clocks may disagree).
# KEYS[1]: the key's in-flight set; KEYS[2]: the stem of its per-minute counters.
# ARGV: lease ms, max in flight (0: none), max per minute (0: none), request id.
# Returns 0 (taken), 1 (as many in flight as allowed), 2 (as many this minute as allowed).
_ACQUIRE_KEY_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, max_in_flight, max_rpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if max_in_flight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max_in_flight then return 1 end
end
if max_rpm > 0 then
  local window = KEYS[2] .. ':' .. math.floor(tonumber(t[1]) / 60)
  if tonumber(redis.call('GET', window) or '0') >= max_rpm then return 2 end
  redis.call('INCR', window)
  redis.call('EXPIRE', window, 120)
end
if max_in_flight > 0 then
  redis.call('ZADD', KEYS[1], string.format('%d', now + lease), ARGV[4])
  redis.call('PEXPIRE', KEYS[1], 2 * lease)
end
return 0
"""
# KEYS: in-flight sets; ARGV[1]: lease ms, ARGV[i + 1]: the request id held in KEYS[i].
_REFRESH_KEY_SLOTS = """
local t = redis.call('TIME')
local until_ms = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  + tonumber(ARGV[1]))
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', until_ms, ARGV[i + 1])
  redis.call('PEXPIRE', key, 2 * tonumber(ARGV[1]))
end
return #KEYS
"""
KEY_SLOT_TAKEN, KEY_SLOT_IN_FLIGHT, KEY_SLOT_RATE = 0, 1, 2


class ControlStore:
    """One app's view of the control plane. Owns `client`: `close()` closes it."""

    def __init__(self, client: aioredis.Redis, app: str) -> None:
        self._client = client
        self.keys = ControlKeys(app)

    @classmethod
    def from_url(cls, url: str, app: str) -> ControlStore:
        """No I/O yet: the first command connects.

        A call fails at once when Redis is down: one immediate retry (a pooled connection that
        a restarted Redis closed reconnects), no backoff. redis-py's default, ten retries with
        exponential backoff, held every call for its caller's whole bound during an outage
        (the router's 50 ms prefix lookup, the role poll's 0.5 s), where a refused connection
        can answer in a millisecond."""
        client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=REPLY_TIMEOUT_S,
            retry=Retry(NoBackoff(), 1),
        )
        return cls(client, app)

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

    # API key limits: requests in flight (leased) and started per minute, all routers together.

    async def acquire_key_slot(
        self,
        key_name: str,
        request_id: str,
        max_in_flight: int | None,
        max_per_minute: int | None,
        lease_s: float,
    ) -> int:
        """KEY_SLOT_TAKEN, or why not (KEY_SLOT_IN_FLIGHT / KEY_SLOT_RATE). A slot taken is
        held for `lease_s` unless refreshed; `release_key_slot` gives it back."""
        if not request_id:
            raise ValueError("request_id must be non-empty")
        for name, limit in (("max_in_flight", max_in_flight), ("max_per_minute", max_per_minute)):
            if limit is not None:
                _check_count(name, limit)
        keys = [self.keys.key_in_flight(key_name), self.keys.key_rate(key_name)]
        args: list[int | str] = [
            _lease_ms(lease_s),
            max_in_flight or 0,
            max_per_minute or 0,
            request_id,
        ]
        return int(await self._client.eval(_ACQUIRE_KEY_SLOT, 2, *keys, *args))

    async def refresh_key_slots(self, held: Sequence[tuple[str, str]], lease_s: float) -> None:
        """Extend the leases of (key name, request id) slots this router still holds."""
        if not held:
            return
        keys = [self.keys.key_in_flight(name) for name, _ in held]
        ids = [request_id for _, request_id in held]
        await self._client.eval(_REFRESH_KEY_SLOTS, len(keys), *keys, _lease_ms(lease_s), *ids)

    async def release_key_slot(self, key_name: str, request_id: str) -> None:
        await self._client.zrem(self.keys.key_in_flight(key_name), request_id)

    async def key_slots_in_flight(self, key_name: str) -> int:
        """Slots held now (expired leases not counted)."""
        now_s, now_us = await self._client.time()
        now_ms = now_s * 1000 + now_us // 1000
        key = self.keys.key_in_flight(key_name)
        return int(await self._client.zcount(key, f"({now_ms}", "+inf"))

    # Roles: which pool's calls each replica takes (control/records.py RoleTable), as the
    # routers read them; the operator's flips are SyncControlStore.flip.

    async def roles_version(self) -> int:
        """One GET: what a router polls, to read the table only when it changed."""
        raw = await self._client.get(self.keys.roles_version)
        return 0 if raw is None else int(_text(raw))

    async def role_table(self) -> RoleTable:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.roles_version)
            pipe.hgetall(self.keys.roles)
            version, flipped = await pipe.execute()
        return RoleTable(
            version=0 if version is None else int(_text(version)),
            flipped={_text(k): _text(v) for k, v in flipped.items()},
        )

    async def ack_roles(self, router_id: str, version: int) -> None:
        """`router_id` routes by roles `version` now (what a flip waits for)."""
        applied = RolesApplied(version, time.time())
        await self._client.hset(self.keys.roles_applied, router_id, encode_roles_applied(applied))

    # Latency samples: one capped list per metric, newest first.

    async def record_sample(
        self, metric: str, value_s: float, cap: int = DEFAULT_SAMPLE_CAP
    ) -> None:
        await self.record_samples({metric: value_s}, cap)

    async def record_samples(
        self, values: Mapping[str, float], cap: int = DEFAULT_SAMPLE_CAP
    ) -> None:
        """One request's samples, every metric in one round trip."""
        for metric, value_s in values.items():
            if not math.isfinite(value_s) or value_s < 0:
                raise ValueError(f"a {metric} sample must be a finite number >= 0, got {value_s}")
        _check_count("cap", cap)
        keyed = [(self.keys.samples(metric), value_s) for metric, value_s in values.items()]
        async with self._client.pipeline(transaction=False) as pipe:
            for key, value_s in keyed:
                pipe.lpush(key, repr(float(value_s)))
                pipe.ltrim(key, 0, cap - 1)
            await pipe.execute()

    async def recent_samples(self, metric: str, n: int = 1000) -> list[float]:
        """Up to `n` samples in seconds, newest first."""
        _check_count("n", n)
        values = await self._client.lrange(self.keys.samples(validate_metric(metric)), 0, n - 1)
        return [float(_text(value)) for value in values]


logger = logging.getLogger(__name__)

# A replica's status write runs on Serve's routing-stats period: it must end well within it.
PUBLISH_TIMEOUT_S = 1.0


class LoadPublisher:
    """How a replica publishes its load: `build_app` puts one in each scaled pool's settings
    (the replica packages sit below control/ and do not import it). Picklable, since Serve
    passes it to the replica: it carries the URL, and connects there on first use."""

    def __init__(self, url: str, app: str) -> None:
        self.url = url
        self.app = ControlKeys(app).app
        self._store: ControlStore | None = None
        self._writes = BestEffort("publishing replica status to Redis", logger, PUBLISH_TIMEOUT_S)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoadPublisher, (self.url, self.app))

    def __repr__(self) -> str:  # never the URL: it carries the password
        return f"LoadPublisher(app={self.app!r})"

    async def publish(self, load: ReplicaLoad) -> bool:
        """Whether the load was written; never raises (status is informational: routing and
        serving go on while Redis is away)."""
        if self._store is None:
            self._store = ControlStore.from_url(self.url, self.app)
        store = self._store
        return await self._writes.run(lambda: store.put_replica_load(load))


def _text(value: bytes | str) -> str:
    """Redis values arrive as bytes, or as str on a client made with decode_responses=True."""
    return value.decode() if isinstance(value, bytes) else value


def _lease_ms(lease_s: float) -> int:
    if not math.isfinite(lease_s) or lease_s <= 0:
        raise ValueError(f"lease_s must be a finite number > 0, got {lease_s}")
    return max(1, round(lease_s * 1000))


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
