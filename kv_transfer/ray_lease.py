"""KVLeaseRegistry: a named Ray actor holding the ObjectRefs of each stored request under a lease.

The producer's engine worker puts one object per layer (it stays their owner), then registers
the refs here synchronously; holding them makes this actor a borrower, which keeps the objects
alive after the producer drops its own refs and frees its KV blocks. Releasing a key or letting
its lease expire drops the refs, and Ray frees the objects. Objects still die with their owner
process: a consumer then finds them lost and reports a load failure.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from kv_transfer.leases import LeaseTable
from kv_transfer.ray_params import RayKVHandoff


@dataclass
class StoredKV:
    """One request's KV as held by the registry: layer objects, checksum table, handoff."""

    refs: list[Any]  # ray.ObjectRef per layer, each a uint8 array [num_blocks, *block bytes]
    checksums: list[list[int]]  # [layer][block] crc32
    handoff: RayKVHandoff


class KVLeaseRegistry:
    """Expired leases are dropped by a background sweep (so an idle registry frees their
    objects too) and before every read, so `num_live` is exact for leak checks."""

    def __init__(self, sweep_interval_s: float = 1.0) -> None:
        self._table: LeaseTable[StoredKV] = LeaseTable()
        self._lock = threading.Lock()
        threading.Thread(target=self._sweep_loop, args=(sweep_interval_s,), daemon=True).start()

    def _sweep_loop(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            self.sweep_expired()

    def register_many(self, entries: list[tuple[str, StoredKV]], lease_seconds: float) -> None:
        with self._lock:
            for key, stored in entries:
                expires_at = self._table.register(key, stored, lease_seconds)
                stored.handoff = stored.handoff.with_expiry(expires_at)

    def describe(self, key: str) -> dict[str, Any] | None:
        """The handoff dict for `key` (with its expiry), or None when unknown or expired."""
        with self._lock:
            lease = self._table.take(key)
        return None if lease is None else lease.payload.handoff.to_dict()

    def take_many(self, keys: list[str]) -> dict[str, StoredKV | None]:
        """Lend the stored KV of each key; the lease stays until `release_many` or expiry."""
        with self._lock:
            leases = {key: self._table.take(key) for key in keys}
        return {key: None if lease is None else lease.payload for key, lease in leases.items()}

    def release_many(self, keys: list[str]) -> int:
        with self._lock:
            return self._table.release_many(keys)

    def release_owner(self, owner: str) -> int:
        with self._lock:
            return self._table.release_owner(owner)

    def sweep_expired(self) -> int:
        with self._lock:
            return len(self._table.sweep_expired())

    def num_live(self, producer: str | None = None) -> int:
        with self._lock:
            return self._table.num_live(producer)

    def live_keys(self) -> list[str]:
        """Keys of the live leases (for leak reports and `pdserve status`)."""
        with self._lock:
            return self._table.live_keys()


def start_lease_registry(name: str, namespace: str | None = None, *, detached: bool = False) -> Any:
    """Start the named registry, or return the running one of that name. Ray restarts it when
    its process dies, under the same name and behind the same handles: the leases it held are
    gone (their consumers fail the load, and recompute or move the request), new ones work."""
    options: dict[str, Any] = {
        "name": name,
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
        # A call that met the dead process runs again on the new one (an engine's handle may
        # not know of the restart yet).
        "max_task_retries": 3,
    }
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(KVLeaseRegistry).options(**options).remote()


def get_lease_registry(name: str, namespace: str | None = None) -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise RuntimeError(
            f"KV lease registry {name!r} not found in Ray namespace {namespace!r}: start it with "
            "kv_transfer.ray_lease.start_lease_registry before the engines"
        ) from exc
