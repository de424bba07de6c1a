"""Lease bookkeeping: stored KV kept under a key until released or expired. Pure, clock injected.

The `KVLeaseRegistry` Ray actor (ray_lease.py) is a thin shell around one `LeaseTable`.
Ownership: whoever registers a key hands its payload to the table; `take` lends it (the entry
stays until `release` or expiry, so a consumer that dies mid-load leaks nothing past the lease);
`release` and expiry drop it, which is what lets the stored objects be freed.

A release can overtake its registration: vLLM schedules the next step while the worker still
runs the last one, so a request aborted just after its save was scheduled is released by the
scheduler before the worker has registered the save. A registration can also come twice: the
registry's calls are retried (at least once, `max_task_retries`), and a call whose reply a cut
link lost runs again after the link is back, maybe after its key was released. So every
release leaves a tombstone, and a registration of a released key drops its payload at once
instead of holding it for a whole lease: register and release commute, and each may repeat.

Keys are "<owner>/<nonce>" (`lease_owner`). A producer that abandons a request without ever
seeing its handoff (its client aborted just as the engine finished the prompt, so the engine's
output, and the key in it, was dropped) releases by owner: every lease of that owner goes, and a
later registration under it is refused the same way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Lease(Generic[T]):
    payload: T
    expires_at: float


# How long a released key refuses registrations (a late one, or a repeated one). Keys are unique
# per save, so a tombstone only ever meets registrations of the one save it was meant for. One
# small entry per handoff for this long: some 9 MB at 100 handoffs a second.
TOMBSTONE_SECONDS = 600.0


def make_lease_key(owner: str) -> str:
    """The key "<owner>/<nonce>". The nonce keeps keys unique when a restarted producer reuses
    request ids."""
    return f"{owner}/{uuid.uuid4().hex[:12]}"


def lease_owner(key: str) -> str:
    """The owner part of a "<owner>/<nonce>" key (the whole key when it has no "/")."""
    return key.rpartition("/")[0] or key


class LeaseTable(Generic[T]):
    def __init__(
        self, clock: Callable[[], float] = time.time, tombstone_seconds: float = TOMBSTONE_SECONDS
    ) -> None:
        self._clock = clock
        self._tombstone_seconds = tombstone_seconds
        self._leases: dict[str, Lease[T]] = {}
        self._tombstones: dict[str, float] = {}  # key -> until when a registration is refused
        self._owner_tombstones: dict[str, float] = {}  # the same, for every key of an owner

    def register(self, key: str, payload: T, lease_seconds: float) -> float:
        """Store `payload` under `key` (replacing any earlier one); returns the expiry time. A
        key released before it was registered is not stored (returns the current time)."""
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        now = self._clock()
        if self._tombstones.get(key, 0.0) > now:
            return now
        if self._owner_tombstones.get(lease_owner(key), 0.0) > now:
            return now
        expires_at = now + lease_seconds
        self._leases[key] = Lease(payload, expires_at)
        return expires_at

    def take(self, key: str) -> Lease[T] | None:
        """The live lease under `key`; None when unknown or expired (an expired one is dropped)."""
        lease = self._leases.get(key)
        if lease is None:
            return None
        if lease.expires_at <= self._clock():
            del self._leases[key]
            return None
        return lease

    def release(self, key: str) -> bool:
        """Drop `key` and refuse its registrations from now on (one still on its way, or a
        repeat); False when it was not live (already released, expired, or not yet
        registered)."""
        self._tombstones[key] = self._clock() + self._tombstone_seconds
        return self._leases.pop(key, None) is not None

    def release_many(self, keys: Iterable[str]) -> int:
        return sum(self.release(key) for key in keys)

    def release_owner(self, owner: str) -> int:
        """Drop every lease of `owner` and refuse its later registrations; returns how many
        leases were dropped."""
        keys = [key for key in self._leases if lease_owner(key) == owner]
        for key in keys:
            del self._leases[key]
        self._owner_tombstones[owner] = self._clock() + self._tombstone_seconds
        return len(keys)

    def sweep_expired(self) -> list[str]:
        now = self._clock()
        expired = [key for key, lease in self._leases.items() if lease.expires_at <= now]
        for key in expired:
            del self._leases[key]
        for tombstones in (self._tombstones, self._owner_tombstones):
            for key in [k for k, until in tombstones.items() if until <= now]:
                del tombstones[key]
        return expired

    @property
    def num_tombstones(self) -> int:
        return len(self._tombstones) + len(self._owner_tombstones)

    def num_live(self, producer: str | None = None) -> int:
        """Live leases, or those of keys under `producer` ("<producer>/...") only."""
        self.sweep_expired()
        if producer is None:
            return len(self._leases)
        return sum(1 for key in self._leases if key.startswith(f"{producer}/"))

    def live_keys(self) -> list[str]:
        self.sweep_expired()
        return sorted(self._leases)
