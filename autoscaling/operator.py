"""Sync access to one app's control plane, for callers without an event loop.

- The operator's helpers behind `pdserve slo` / `pdserve scale` (deploy/cli_ops.py): one short
  connection per call.
- `ControlReader`: what the Serve autoscaling policies (serve_policy.py) read each tick from
  inside the Serve controller, whose loop calls them synchronously.

Keys come from control/keys.py and values go through control/records.py, as in
the async `ControlStore`, so both sides read what the other writes. Redis is never the KV path.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from autoscaling.config import PoolSLO, ReplicaBounds
from control.keys import POOLS, ControlKeys, validate_pool
from control.records import (
    DecisionRecord,
    decode_bounds,
    decode_decision,
    decode_pin,
    decode_slo,
    encode_bounds,
    encode_decision,
    encode_pin,
    encode_slo,
)
from control.store import DEFAULT_DECISION_CAP

CLI_TIMEOUT_S = 5.0


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A sync client that fails within `timeout_s` and never retries on its own."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


@contextmanager
def _session(url: str) -> Iterator[redis.Redis]:
    client = connect(url, CLI_TIMEOUT_S)
    try:
        yield client
    finally:
        client.close()


def get_slo(url: str, app: str) -> PoolSLO | None:
    """The SLO stored for `app`; None: none set, the pools use their configured defaults."""
    with _session(url) as client:
        raw = client.get(ControlKeys(app).slo)
    return None if raw is None else decode_slo(raw)


def set_slo(
    url: str, app: str, ttft_p95_s: float | None = None, tpot_p95_s: float | None = None
) -> PoolSLO:
    """Set either target or both; the other keeps its stored value (PoolSLO's default if none
    is stored). Returns the SLO now stored."""
    if ttft_p95_s is None and tpot_p95_s is None:
        raise ValueError("set at least one of the TTFT P95 and TPOT P95 targets")
    keys = ControlKeys(app)
    with _session(url) as client:
        raw = client.get(keys.slo)
        current = PoolSLO() if raw is None else decode_slo(raw)
        slo = PoolSLO(
            ttft_p95_s=current.ttft_p95_s if ttft_p95_s is None else ttft_p95_s,
            tpot_p95_s=current.tpot_p95_s if tpot_p95_s is None else tpot_p95_s,
        )
        client.set(keys.slo, encode_slo(slo))
    return slo


def get_bounds(url: str, app: str, pool: str) -> ReplicaBounds | None:
    with _session(url) as client:
        raw = client.get(ControlKeys(app).bounds(pool))
    return None if raw is None else decode_bounds(raw)


def set_bounds(
    url: str, app: str, pool: str, min_replicas: int, max_replicas: int
) -> ReplicaBounds:
    bounds = ReplicaBounds(min_replicas, max_replicas)
    with _session(url) as client:
        client.set(ControlKeys(app).bounds(pool), encode_bounds(bounds))
    return bounds


def pin(url: str, app: str, pool: str, num_replicas: int) -> None:
    """Hold `pool` at `num_replicas` (clamped into its bounds by the policy) until `unpin`."""
    key = ControlKeys(app).pin(pool)
    value = encode_pin(num_replicas)
    with _session(url) as client:
        client.set(key, value)


def unpin(url: str, app: str, pool: str) -> bool:
    """Release the pin: the pool scales on its SLO again. False when there was none."""
    with _session(url) as client:
        return bool(client.delete(ControlKeys(app).pin(pool)))


def pins(url: str, app: str) -> dict[str, int | None]:
    """Each pool's pin (None: not pinned)."""
    keys = ControlKeys(app)
    with _session(url) as client:
        values = client.mget([keys.pin(pool) for pool in POOLS])
    return {
        pool: None if raw is None else decode_pin(raw)
        for pool, raw in zip(POOLS, values, strict=True)
    }


def recent_decisions(
    url: str, app: str, n: int = 20, pool: str | None = None
) -> list[DecisionRecord]:
    """Up to `n` logged decisions, newest first, of one pool or of both."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if pool is not None:
        validate_pool(pool)
    with _session(url) as client:
        # The log is capped (DEFAULT_DECISION_CAP), so one read of it all is small.
        stop = n - 1 if pool is None else DEFAULT_DECISION_CAP - 1
        values = client.lrange(ControlKeys(app).decisions, 0, stop)
    records = [decode_decision(value) for value in values]
    return [r for r in records if pool is None or r.pool == pool][:n]


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)\s*")


def parse_duration(text: str) -> float:
    """Seconds in "500ms", "0.5s", "2s" or "1m". A unit is required: a bare "500" could mean
    milliseconds or seconds, and guessing wrong sets an SLO a thousand times off."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"duration must be a number with a unit ms, s or m (e.g. 500ms, 0.5s, 1m), got {text!r}"
        )
    value, unit = float(match.group(1)), match.group(2)
    # Divide for ms: 300 / 1000 is exactly 0.3, 300 * 0.001 is not.
    seconds = value / 1000 if unit == "ms" else value * 60 if unit == "m" else value
    if not math.isfinite(seconds):
        raise ValueError(f"duration is out of range: {text!r}")
    return seconds


# --- The policies' side: read each tick from the Serve controller ---------------------------

_RETRY_AFTER_FAILURE_S = 10.0


@dataclass(frozen=True)
class ControlSettings:
    """One pool's SLO, bounds and pin; `error` says why they are a fallback, not Redis's."""

    slo: PoolSLO
    bounds: ReplicaBounds
    pin: int | None = None
    error: str | None = None


class ControlReader:
    """One pool's settings from Redis, read at most every `refresh_s` (the controller calls
    the policy ~10 times a second) and not at all for 10 s after a failure, so a dead Redis
    costs one `timeout_s` stall per 10 s. Meanwhile the last good read, or the defaults, stand
    in with `error` set.

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
        self._keys = ControlKeys(app)
        self._pool = validate_pool(pool)
        self._defaults = defaults
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._client: redis.Redis | None = None
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
            raw_slo, raw_bounds, raw_pin = self._redis().mget(
                [self._keys.slo, self._keys.bounds(self._pool), self._keys.pin(self._pool)]
            )
            self._settings = ControlSettings(
                slo=self._defaults.slo if raw_slo is None else decode_slo(raw_slo),
                bounds=self._defaults.bounds if raw_bounds is None else decode_bounds(raw_bounds),
                pin=None if raw_pin is None else decode_pin(raw_pin),
            )
            self._has_read = self._is_reachable = True
            self._next_read_s = now_s + self._refresh_s
        except (redis.RedisError, OSError, ValueError, LookupError) as error:
            self._fail(now_s, error)
        return self._settings

    def append(self, record: DecisionRecord) -> bool:
        """Log `record`; False when there is no Redis, or it failed (it is retried later)."""
        if not self.is_enabled or not self._is_reachable:
            return False
        try:
            with self._redis().pipeline(transaction=False) as pipe:
                pipe.lpush(self._keys.decisions, encode_decision(record))
                pipe.ltrim(self._keys.decisions, 0, DEFAULT_DECISION_CAP - 1)
                pipe.execute()
        except (redis.RedisError, OSError) as error:
            self._fail(record.at, error)
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

    def _redis(self) -> redis.Redis:
        if self._client is None:
            url = self._url or os.environ.get(self._url_env or "")
            if not url:
                raise LookupError(
                    f"{self._url_env} is not set in the Serve controller's environment"
                )
            self._client = connect(url, self._timeout_s)
        return self._client
