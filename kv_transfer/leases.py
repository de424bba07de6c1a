"""Lease bookkeeping: stored KV kept under a key until released or expired. Pure, clock injected.

The `KVLeaseRegistry` Ray actor (ray_lease.py) is a thin shell around one `LeaseTable`.
Ownership: whoever registers a key hands its payload to the table; `take` lends it (the entry
stays until `release` or expiry, so a consumer that dies mid-load leaks nothing past the lease);
`release` and expiry drop it, which is what lets the stored objects be freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Lease(Generic[T]):
    payload: T
    expires_at: float


class LeaseTable(Generic[T]):
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._leases: dict[str, Lease[T]] = {}

    def register(self, key: str, payload: T, lease_seconds: float) -> float:
        """Store `payload` under `key` (replacing any earlier one); returns the expiry time."""
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        expires_at = self._clock() + lease_seconds
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
        """Drop `key`; False when it was unknown (already released or expired)."""
        return self._leases.pop(key, None) is not None

    def release_many(self, keys: Iterable[str]) -> int:
        return sum(self.release(key) for key in keys)

    def sweep_expired(self) -> list[str]:
        now = self._clock()
        expired = [key for key, lease in self._leases.items() if lease.expires_at <= now]
        for key in expired:
            del self._leases[key]
        return expired

    def num_live(self) -> int:
        self.sweep_expired()
        return len(self._leases)

    def live_keys(self) -> list[str]:
        self.sweep_expired()
        return sorted(self._leases)
