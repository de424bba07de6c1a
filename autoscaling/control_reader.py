"""`ControlReader`: one pool's SLO, bounds and pin as its Serve policy reads them each tick,
and the decision log it appends to, through the control plane's sync face.

The Serve controller calls the policy ~10 times a second, synchronously: a dead or slow Redis
must neither stall it for long nor stop the pool from scaling, so the reader refreshes at most
every `refresh_s`, backs off 10 s after a failure, and meanwhile answers with the last good read
(or the defaults) and an `error` that says why.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import redis

from autoscaling.roles import OTHER_POOL
from control.keys import POOLS, ControlKeys, validate_pool
from control.records import DecisionRecord, PoolSLO, ReplicaBounds, RoleTable
from control.sync_store import SyncControlStore

_RETRY_AFTER_FAILURE_S = 10.0

logger = logging.getLogger("ray.serve.pdserve")


class RolesSnapshot(NamedTuple):
    table: RoleTable
    replicas: dict[str, list[str]]  # pool -> live worker ids
    other_last: DecisionRecord | None  # the other pool's latest decision


@dataclass(frozen=True)
class ControlSettings:
    """One pool's SLO, bounds and pin; `error` says why they are a fallback, not Redis's."""

    slo: PoolSLO
    bounds: ReplicaBounds
    pin: int | None = None
    error: str | None = None


class ControlReader:
    """One pool's settings from Redis, read at most every `refresh_s` and not at all for 10 s
    after a failure, so a dead Redis costs one `timeout_s` stall per 10 s.

    The URL is `redis_url`, or the environment variable `redis_url_env` of the process that
    reads (the Serve controller), which keeps the password out of Serve's config and logs.
    Neither: the defaults, and no decision log.
    """

    def __init__(
        self,
        redis_url: str | None,
        app: str,
        pool: str,
        defaults: ControlSettings,
        refresh_s: float,
        timeout_s: float,
        redis_url_env: str | None = None,
    ) -> None:
        if redis_url is not None and redis_url_env is not None:
            raise ValueError("give redis_url or redis_url_env, not both")
        self._url = redis_url
        self._url_env = redis_url_env
        self._app = ControlKeys(app).app  # A bad name fails here, not on the first read.
        self._pool = validate_pool(pool)
        self._defaults = defaults
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._store: SyncControlStore | None = None
        self._settings = defaults
        self._has_read = False
        self._is_reachable = True
        self._next_read_s = -math.inf

    @property
    def is_enabled(self) -> bool:
        return self._url is not None or self._url_env is not None

    def read(self, now_s: float) -> ControlSettings:
        if not self.is_enabled or now_s < self._next_read_s:
            return self._settings
        try:
            stored = self._connected().pool_settings(self._pool)
            self._settings = ControlSettings(
                slo=self._defaults.slo if stored.slo is None else stored.slo,
                bounds=self._defaults.bounds if stored.bounds is None else stored.bounds,
                pin=stored.pin,
            )
            self._has_read = self._is_reachable = True
            self._next_read_s = now_s + self._refresh_s
        except (redis.RedisError, OSError, ValueError, LookupError) as error:
            self._fail(now_s, error)
        return self._settings

    def append(self, record: DecisionRecord, logged: bool = True) -> bool:
        """Keep `record` as the pool's latest decision and, when `logged`, add it to the log;
        False when there is no Redis, or it failed (it is retried later)."""
        if not self.is_enabled or not self._is_reachable:
            return False
        try:
            store = self._connected()
            store.set_last_decision(record)
            if logged:
                store.append_decision(record)
        except (redis.RedisError, OSError) as error:
            self._fail(record.at, error)
            return False
        return True

    def roles(self, replica_age_s: float) -> RolesSnapshot | None:
        """The role table, each pool's live replicas and the other pool's latest decision, for
        a flip (autoscaling/roles.py); None without Redis or when it fails (then the pool just
        scales)."""
        if not self.is_enabled or not self._is_reachable:
            return None
        try:
            store = self._connected()
            return RolesSnapshot(
                store.role_table(),
                {pool: store.replica_ids(pool, replica_age_s) for pool in POOLS},
                store.last_decision(OTHER_POOL[self._pool]),
            )
        except (redis.RedisError, OSError, ValueError) as error:
            logger.warning("pdserve %s autoscaler: reading the roles failed: %s", self._pool, error)
            return None

    def flip(self, worker_id: str, role: str) -> bool:
        """Flip `worker_id` to `role`'s calls; False when it could not be written."""
        try:
            self._connected().flip(worker_id, role)
        except (redis.RedisError, OSError, ValueError) as error:
            logger.warning(
                "pdserve %s autoscaler: flipping %s failed: %s", self._pool, worker_id, error
            )
            return False
        return True

    def _fail(self, now_s: float, error: Exception) -> None:
        if isinstance(error, ValueError):  # Redis answered, with a value no writer of ours wrote.
            what = f"bad control-plane value ({error})"
        elif isinstance(error, LookupError):
            what = str(error.args[0])
        else:  # The type only: an error text may quote the server's address.
            what = f"control plane unreachable ({type(error).__name__})"
            self._is_reachable = False
        source = "last known" if self._has_read else "default"
        # Only the note changes: the SLO, bounds and pin stay what they were.
        self._settings = replace(self._settings, error=f"{what}; {source} SLO, bounds, pin")
        self._next_read_s = now_s + _RETRY_AFTER_FAILURE_S

    def _connected(self) -> SyncControlStore:
        if self._store is None:
            url = self._url or os.environ.get(self._url_env or "")
            if not url:
                raise LookupError(
                    f"{self._url_env} is not set in the Serve controller's environment"
                )
            self._store = SyncControlStore.connect(url, self._app, self._timeout_s)
        return self._store
