"""Per-key limits (router/auth.KeyLimits: `concurrency=N`, `rpm=N` in the keys file), held for
all router replicas together.

With a control plane (`SharedKeyLimiter`), Redis holds the counts, one script per request
(control/store.py): a key's requests in flight are leased slots that the router streaming them
refreshes every lease/3, so a router that dies frees its slots within one lease; requests
started are counted per minute of Redis's own clock. Without one (`LocalKeyLimiter`), each
router replica counts its own, so the limits hold per replica.

A request past a limit raises KeyLimited, which the router answers like overload (HTTP 429,
gRPC RESOURCE_EXHAUSTED) naming the key and the limit. A control plane that cannot be reached
does not refuse requests: the limits are skipped and the failure logged (once a minute); a
request waits at most 100 ms for Redis, and none while a circuit breaker skips it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from control.breaker import CircuitBreaker
from control.store import KEY_SLOT_IN_FLIGHT, KEY_SLOT_TAKEN, ControlStore
from router.auth import KeyLimits

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
# A request waits this long at most for its key's slot in Redis (then it is served unlimited);
# a release or a lease refresh, off the request's path, this long.
ACQUIRE_TIMEOUT_S = 0.1
RELEASE_TIMEOUT_S = 1.0


class KeyLimited(Exception):
    """A request past its API key's limit (HTTP 429 / gRPC RESOURCE_EXHAUSTED)."""


def _refusal(name: str, limits: KeyLimits, in_flight: bool) -> KeyLimited:
    if in_flight:
        what = f"at most {limits.max_concurrent} requests in flight"
    else:
        what = f"at most {limits.max_per_minute} requests per minute"
    return KeyLimited(f"API key '{name}' is at its limit ({what}); retry later")


class KeyLimiter(Protocol):
    async def acquire(self, name: str, limits: KeyLimits, request_id: str) -> None:
        """Take a slot for `request_id` or raise KeyLimited."""

    async def release(self, name: str, request_id: str) -> None:
        """Give back the slot `acquire` took (a no-op for one it did not)."""


class LocalKeyLimiter:
    """This router replica's own counts (no control plane)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._in_flight: dict[str, set[str]] = {}
        self._minutes: dict[str, tuple[int, int]] = {}  # name -> (minute, requests started)

    async def acquire(self, name: str, limits: KeyLimits, request_id: str) -> None:
        held = self._in_flight.setdefault(name, set())
        if limits.max_concurrent is not None and len(held) >= limits.max_concurrent:
            raise _refusal(name, limits, in_flight=True)
        if limits.max_per_minute is not None:
            minute = int(self._clock() // 60)
            start, count = self._minutes.get(name, (minute, 0))
            count = count if start == minute else 0
            if count >= limits.max_per_minute:
                raise _refusal(name, limits, in_flight=False)
            self._minutes[name] = (minute, count + 1)
        if limits.max_concurrent is not None:
            held.add(request_id)

    async def release(self, name: str, request_id: str) -> None:
        self._in_flight.get(name, set()).discard(request_id)


class SharedKeyLimiter:
    """All router replicas' counts, in the control plane's Redis. Each acquire waits at most
    `timeout_s` (100 ms) for Redis, and after failures in a row a circuit breaker skips Redis
    for a while (one trial call then decides): a silent or dead control plane costs a request
    at most that, then nothing, and the limits are skipped meanwhile."""

    def __init__(
        self,
        store: ControlStore,
        lease_s: float = DEFAULT_LEASE_S,
        timeout_s: float = ACQUIRE_TIMEOUT_S,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self._store = store
        self._lease_s = lease_s
        self._timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._held: dict[tuple[str, str], None] = {}  # (key name, request id), in order
        self._refresher: asyncio.Task[None] | None = None
        self._last_warning = 0.0

    async def acquire(self, name: str, limits: KeyLimits, request_id: str) -> None:
        if not self.breaker.allow():
            return  # the control plane failed lately: serve without limits until a trial
        try:
            outcome = await asyncio.wait_for(
                self._store.acquire_key_slot(
                    name, request_id, limits.max_concurrent, limits.max_per_minute, self._lease_s
                ),
                self._timeout_s,
            )
        except Exception as exc:  # the control plane is down or silent: serve, and say so
            self.breaker.failed()
            self._warn(f"API key limits skipped, the control plane failed: {exc!r}")
            return
        self.breaker.succeeded()
        if outcome != KEY_SLOT_TAKEN:
            raise _refusal(name, limits, in_flight=outcome == KEY_SLOT_IN_FLIGHT)
        if limits.max_concurrent is not None:
            self._held[(name, request_id)] = None
            if self._refresher is None or self._refresher.done():
                self._refresher = asyncio.create_task(self._refresh_forever())

    async def release(self, name: str, request_id: str) -> None:
        if (name, request_id) not in self._held:
            return  # refused, or a key without a concurrency limit
        del self._held[(name, request_id)]
        try:
            await asyncio.wait_for(
                self._store.release_key_slot(name, request_id), RELEASE_TIMEOUT_S
            )
        except Exception as exc:  # its lease runs out instead
            self._warn(f"an API key slot was not released (its lease expires): {exc}")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher

    async def _refresh_forever(self) -> None:
        while self._held:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await asyncio.wait_for(
                    self._store.refresh_key_slots(list(self._held), self._lease_s),
                    RELEASE_TIMEOUT_S,
                )
            except Exception as exc:
                self._warn(f"API key leases not refreshed: {exc}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 60:
            self._last_warning = now
            logger.warning(message)
