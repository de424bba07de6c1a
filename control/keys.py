"""Every Redis key pdserve writes, all under `pdserve:{app}:` so apps can share one server.

    pdserve:{app}:replicas:{pool}       hash   replica_id -> ReplicaLoad JSON
    pdserve:{app}:prefix:{hash_hex}     string prefill replica id, expires (PX)
    pdserve:{app}:samples:{metric}      list   latency samples in seconds, newest first, capped
    pdserve:{app}:slo                   string PoolSLO JSON
    pdserve:{app}:bounds:{pool}         string ReplicaBounds JSON
    pdserve:{app}:pin:{pool}            string pinned replica count
    pdserve:{app}:decisions             list   DecisionRecord JSON, newest first, capped
    pdserve:{app}:roles                 hash   worker id -> the pool whose calls it takes, for
                                               replicas flipped out of their own (router/roles.py)
    pdserve:{app}:roles:version         string the roles' version, incremented by each flip
    pdserve:{app}:roles:applied         hash   router id -> "version unix-seconds" it applied
    pdserve:{app}:apikey:{name}:in_flight        zset   request id -> lease expiry (ms, Redis clock)
    pdserve:{app}:apikey:{name}:rpm:{minute}     string requests started in that minute, expires

Pure: no redis import. Names are validated here, once, so a typo in a pool or metric is a
ValueError instead of a key nobody reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

POOLS = ("prefill", "decode")
# Latencies in seconds, and `local_prefill`: 1 for a disaggregated request whose prompt its
# decode replica computed itself, 0 for one the prefill pool computed (the split status shows).
LOCAL_PREFILL_METRIC = "local_prefill"
METRICS = ("ttft", "tpot", "queue_wait", "prefill", "kv_transfer", LOCAL_PREFILL_METRIC)
KEY_ROOT = "pdserve"

# No ':' (it separates key parts), no whitespace or braces (Redis Cluster hash tags).
_APP_NAME = re.compile(r"[A-Za-z0-9_.-]+")

# Where processes find the control plane's URL (it carries the password, so not in configs).
REDIS_URL_ENV = "PDSERVE_REDIS_URL"


# API key names (router/auth.py allows the same characters).
_KEY_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _key_name(name: str) -> str:
    if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
        raise ValueError(f"API key name must be 1-64 of A-Z a-z 0-9 _ . @ -, got {name!r}")
    return name


def validate_pool(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    return pool


def validate_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    return metric


@dataclass(frozen=True)
class ControlKeys:
    """The key names of one app; cheap to build, no I/O."""

    app: str

    def __post_init__(self) -> None:
        if not isinstance(self.app, str) or not _APP_NAME.fullmatch(self.app):
            raise ValueError(
                f"app name must be non-empty and use only letters, digits, '_', '.', '-'; "
                f"got {self.app!r}"
            )

    @property
    def namespace(self) -> str:
        """The prefix every key of this app starts with (`pdserve:{app}:`)."""
        return f"{KEY_ROOT}:{self.app}:"

    def replicas(self, pool: str) -> str:
        return f"{self.namespace}replicas:{validate_pool(pool)}"

    def prefix(self, block_hash: bytes) -> str:
        if not isinstance(block_hash, bytes) or not block_hash:
            raise ValueError(f"block hash must be non-empty bytes, got {block_hash!r}")
        return f"{self.namespace}prefix:{block_hash.hex()}"

    def samples(self, metric: str) -> str:
        return f"{self.namespace}samples:{validate_metric(metric)}"

    @property
    def slo(self) -> str:
        return f"{self.namespace}slo"

    def bounds(self, pool: str) -> str:
        return f"{self.namespace}bounds:{validate_pool(pool)}"

    def pin(self, pool: str) -> str:
        return f"{self.namespace}pin:{validate_pool(pool)}"

    @property
    def decisions(self) -> str:
        return f"{self.namespace}decisions"

    def key_in_flight(self, key_name: str) -> str:
        """An API key's requests in flight, across router replicas (router/key_limits.py)."""
        return f"{self.namespace}apikey:{_key_name(key_name)}:in_flight"

    def key_rate(self, key_name: str) -> str:
        """The stem of an API key's per-minute counters (the minute is appended)."""
        return f"{self.namespace}apikey:{_key_name(key_name)}:rpm"

    @property
    def roles(self) -> str:
        return f"{self.namespace}roles"

    @property
    def roles_version(self) -> str:
        return f"{self.namespace}roles:version"

    @property
    def roles_applied(self) -> str:
        return f"{self.namespace}roles:applied"

    def last_decision(self, pool: str) -> str:
        """The pool's latest decision, rewritten every tick (the log keeps only changes)."""
        return f"{self.namespace}last_decision:{validate_pool(pool)}"
