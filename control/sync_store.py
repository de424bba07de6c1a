"""`SyncControlStore`: the control plane's sync face, for callers without an event loop.

- The operator's commands, `pdserve slo` / `pdserve scale` / `pdserve status` (deploy/): one
  short connection per command.
- The Serve autoscaling policies (autoscaling/control_reader.py), which the Serve controller's
  loop calls synchronously: one MGET per refresh, one append per logged decision.

    operator     get_slo, set_slo, get_bounds, set_bounds, pin, unpin, pins, recent_decisions
    autoscaler   pool_settings, append_decision                                    per tick

The async face (`ControlStore`, store.py) holds what replicas and routers write on the request
path; both use the keys of keys.py and the codecs of records.py, so each reads what the other
writes. Redis is never the KV path.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from control.keys import POOLS, ControlKeys, validate_pool
from control.records import (
    DecisionRecord,
    PoolSLO,
    ReplicaBounds,
    RolesApplied,
    RoleTable,
    decode_bounds,
    decode_decision,
    decode_pin,
    decode_replica_load,
    decode_roles_applied,
    decode_slo,
    encode_bounds,
    encode_decision,
    encode_pin,
    encode_slo,
)
from prefill_workers.replica import pool_of

CLI_TIMEOUT_S = 5.0
DECISION_CAP = 1000


class PoolSettings(NamedTuple):
    """What the control plane holds for one pool; None where nothing is stored."""

    slo: PoolSLO | None
    bounds: ReplicaBounds | None
    pin: int | None


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A sync client that fails within `timeout_s` and never retries on its own."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


class SyncControlStore:
    """One app's SLO, bounds, pins and decision log. Owns `client`: `close()` closes it."""

    def __init__(self, client: redis.Redis, app: str) -> None:
        self._client = client
        self.keys = ControlKeys(app)

    @classmethod
    def connect(cls, url: str, app: str, timeout_s: float = CLI_TIMEOUT_S) -> SyncControlStore:
        """No I/O yet: the first command connects (and fails within `timeout_s`)."""
        return cls(connect(url, timeout_s), app)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SyncControlStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # SLO, bounds and pins: set by the operator, read by the autoscaler every refresh.

    def get_slo(self) -> PoolSLO | None:
        """The SLO stored for the app; None: none set, the pools use their configured defaults."""
        raw = self._client.get(self.keys.slo)
        return None if raw is None else decode_slo(raw)

    def set_slo(self, ttft_p95_s: float | None = None, tpot_p95_s: float | None = None) -> PoolSLO:
        """Set either target or both; the other keeps its stored value (PoolSLO's default if
        none is stored). Returns the SLO now stored."""
        if ttft_p95_s is None and tpot_p95_s is None:
            raise ValueError("set at least one of the TTFT P95 and TPOT P95 targets")
        current = self.get_slo() or PoolSLO()
        slo = PoolSLO(
            ttft_p95_s=current.ttft_p95_s if ttft_p95_s is None else ttft_p95_s,
            tpot_p95_s=current.tpot_p95_s if tpot_p95_s is None else tpot_p95_s,
        )
        self._client.set(self.keys.slo, encode_slo(slo))
        return slo

    def get_bounds(self, pool: str) -> ReplicaBounds | None:
        raw = self._client.get(self.keys.bounds(pool))
        return None if raw is None else decode_bounds(raw)

    def set_bounds(self, pool: str, min_replicas: int, max_replicas: int) -> ReplicaBounds:
        bounds = ReplicaBounds(min_replicas, max_replicas)
        self._client.set(self.keys.bounds(pool), encode_bounds(bounds))
        return bounds

    def pin(self, pool: str, num_replicas: int) -> None:
        """Hold `pool` at `num_replicas` (clamped into its bounds by the policy) until `unpin`."""
        self._client.set(self.keys.pin(pool), encode_pin(num_replicas))

    def unpin(self, pool: str) -> bool:
        """Release the pin: the pool scales on its SLO again. False when there was none."""
        return bool(self._client.delete(self.keys.pin(pool)))

    def pins(self) -> dict[str, int | None]:
        """Each pool's pin (None: not pinned)."""
        values = self._client.mget([self.keys.pin(pool) for pool in POOLS])
        return {
            pool: None if raw is None else decode_pin(raw)
            for pool, raw in zip(POOLS, values, strict=True)
        }

    def pool_settings(self, pool: str) -> PoolSettings:
        """The SLO, `pool`'s bounds and its pin, in one round trip."""
        raw_slo, raw_bounds, raw_pin = self._client.mget(
            [self.keys.slo, self.keys.bounds(pool), self.keys.pin(pool)]
        )
        return PoolSettings(
            slo=None if raw_slo is None else decode_slo(raw_slo),
            bounds=None if raw_bounds is None else decode_bounds(raw_bounds),
            pin=None if raw_pin is None else decode_pin(raw_pin),
        )

    # Decision log: one capped list for both pools, newest first.

    def append_decision(self, record: DecisionRecord) -> None:
        with self._client.pipeline(transaction=False) as pipe:
            pipe.lpush(self.keys.decisions, encode_decision(record))
            pipe.ltrim(self.keys.decisions, 0, DECISION_CAP - 1)
            pipe.execute()

    def set_last_decision(self, record: DecisionRecord) -> None:
        self._client.set(self.keys.last_decision(record.pool), encode_decision(record))

    def last_decision(self, pool: str) -> DecisionRecord | None:
        """The pool's decision of the latest policy tick, logged or not; None before any."""
        raw = self._client.get(self.keys.last_decision(pool))
        return None if raw is None else decode_decision(raw)

    def recent_decisions(self, n: int = 20, pool: str | None = None) -> list[DecisionRecord]:
        """Up to `n` logged decisions, newest first, of one pool or of both."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if pool is not None:
            validate_pool(pool)
        # The log is capped (DECISION_CAP), so one read of it all is small.
        stop = n - 1 if pool is None else DECISION_CAP - 1
        records = [
            decode_decision(value) for value in self._client.lrange(self.keys.decisions, 0, stop)
        ]
        return [r for r in records if pool is None or r.pool == pool][:n]

    # Roles: a flip has a replica take the other pool's calls (its engine is of KV role "both");
    # the routers poll the version and ack what they route by.

    def flip(self, worker_id: str, role: str) -> int:
        """`worker_id` takes `role`'s calls from now on (its own pool's: the flip is undone).
        Returns the roles version the routers must reach for the flip to be in effect."""
        pool = validate_pool(pool_of(worker_id))
        validate_pool(role)
        if not self._client.hexists(self.keys.replicas(pool), worker_id):
            raise ValueError(
                f"replica {worker_id!r} has never reported its load to this app "
                "(`pdserve status` lists the replicas)"
            )
        with self._client.pipeline(transaction=True) as pipe:
            if role == pool_of(worker_id):
                pipe.hdel(self.keys.roles, worker_id)
            else:
                pipe.hset(self.keys.roles, worker_id, role)
            pipe.incr(self.keys.roles_version)
            return int(pipe.execute()[-1])

    def replica_ids(self, pool: str, max_age_s: float | None = None) -> list[str]:
        """The worker ids that reported a load in `pool` (sorted): within `max_age_s` of now,
        or ever (None; a stopped replica's entry stays)."""
        raw = self._client.hgetall(self.keys.replicas(validate_pool(pool)))
        if max_age_s is None:
            return sorted(_str(k) for k in raw)
        now = time.time()
        loads = (decode_replica_load(v) for v in raw.values())
        return sorted(load.replica_id for load in loads if load.is_fresh(now, max_age_s))

    def role_table(self) -> RoleTable:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.roles_version)
            pipe.hgetall(self.keys.roles)
            version, flipped = pipe.execute()
        return RoleTable(
            version=0 if version is None else int(version),
            flipped={_str(k): _str(v) for k, v in flipped.items()},
        )

    def roles_applied(self) -> dict[str, RolesApplied]:
        """Each router's last ack (router id -> the version it routes by, and when)."""
        raw = self._client.hgetall(self.keys.roles_applied)
        return {_str(k): decode_roles_applied(v) for k, v in raw.items()}


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
