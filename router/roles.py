"""Role flips as the routers apply them: which pool's calls each engine replica takes.

Every engine of the KV pools is of KV role "both" (decode_workers/worker.py), so a replica of
the decode pool can prefill for others and one of the prefill pool can decode: its pool is what
Serve scales it in, its role is which calls it gets. A flip is a routing change only, no engine
restart, no weights reloaded:

    operator / autoscaler   SyncControlStore.flip(worker_id, role)   roles hash, version += 1
    each Router replica     RolePoller: GET version every 0.1 s; on a change HGETALL roles,
                            POOL_VIEW.set_roles, then ack the version (roles:applied)
    routing a call          pool_for(role): the deployment whose handle takes it (at random,
                            in proportion to the replicas serving the role in each);
                            serving(): that deployment's request router ranks only the
                            replicas serving the call's role (all of them when none does)

A flip is in effect once every live router acked its version (`pdserve role` waits for that and
says how long it took). Calls already running finish where they are: a replica flipped to
decode keeps its handoffs until pulled, one flipped to prefill streams on to the end.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from control.keys import POOLS
from control.records import RoleTable
from engine.messages import ReplicaLoad

logger = logging.getLogger(__name__)

# The role each engine method serves (the calls a flip moves); other methods (release, abort,
# idle probes) go to any replica of the deployment they are called on.
ROLE_OF_METHOD = {"prefill": "prefill", "decode": "decode", "generate": "decode"}

POLL_PERIOD_S = 0.1
# A router acks at least this often, so the flip command can tell live routers from gone ones.
HEARTBEAT_S = 1.0
# Routers whose last ack is older than this are taken as gone.
LIVE_ACK_S = 5.0
# One Redis round trip of the poll may take this long at most.
POLL_TIMEOUT_S = 0.5


def serving(
    role: str, table: RoleTable, loads: Mapping[str, Sequence[ReplicaLoad]]
) -> list[ReplicaLoad]:
    """The replicas of both KV pools that take `role`'s calls now, by their last loads."""
    return [
        load
        for pool in POOLS
        for load in loads.get(pool, ())
        if table.role_of(load.replica_id) == role
    ]


def pool_for(
    role: str,
    table: RoleTable,
    loads: Mapping[str, Sequence[ReplicaLoad]],
    rng: random.Random | None = None,
) -> str:
    """The KV pool whose handle a call of `role` goes through: one of the pools holding
    replicas serving `role`, at random in proportion to how many each holds (that pool's request
    router then picks the replica by load). Not the pool of the least-loaded replica: loads
    arrive once a routing-stats period, and every call of a burst would go to that one pool.
    `role`'s own pool when no serving replica has reported."""
    counts = Counter(load.pool for load in serving(role, table, loads))
    if not counts:
        return role
    if len(counts) == 1:
        return next(iter(counts))
    pools = sorted(counts)
    return (rng or random).choices(pools, [counts[pool] for pool in pools])[0]


class RoleSource(Protocol):
    async def roles_version(self) -> int: ...

    async def replica_loads(self, pool: str, max_age_s: float = 30.0) -> list[ReplicaLoad]: ...

    async def role_table(self) -> RoleTable: ...

    async def ack_roles(self, router_id: str, version: int) -> None: ...


class RoleSink(Protocol):
    @property
    def roles(self) -> RoleTable: ...

    def set_roles(self, table: RoleTable) -> None: ...

    def knows(self, pool: str) -> bool: ...

    def update(self, pool: str, loads: Iterable[ReplicaLoad | None]) -> None: ...


class RolePoller:
    """Keeps `view`'s roles those of `source` (the control plane), and acks each version it
    applies. Redis being away leaves the last roles in force (logged once per outage).

    It also fills in the loads of a pool the view has not seen yet: the request routers leave
    a pool's loads only when a call goes through its handle, so a router that started after a
    flip would otherwise send a role's first calls to its own pool, whose replicas may all be
    flipped away. The replicas' published loads (`pdserve status`'s) stand in until then."""

    def __init__(
        self,
        source: RoleSource,
        view: RoleSink,
        router_id: str,
        period_s: float = POLL_PERIOD_S,
        heartbeat_s: float = HEARTBEAT_S,
        timeout_s: float = POLL_TIMEOUT_S,
    ) -> None:
        self._source = source
        self._view = view
        self._router_id = router_id
        self._period_s = period_s
        self._heartbeat_s = heartbeat_s
        self._timeout_s = timeout_s
        self._acked: tuple[int, float] | None = None  # (version, monotonic time)
        self._failing = False

    async def poll_once(self) -> None:
        for pool in POOLS:
            if not self._view.knows(pool):
                loads = await asyncio.wait_for(self._source.replica_loads(pool), self._timeout_s)
                if loads and not self._view.knows(pool):  # a routing call may have meanwhile
                    self._view.update(pool, loads)
        version = await asyncio.wait_for(self._source.roles_version(), self._timeout_s)
        if version != self._view.roles.version:
            table = await asyncio.wait_for(self._source.role_table(), self._timeout_s)
            self._view.set_roles(table)
            logger.info("routing by roles version %d: %s", table.version, dict(table.flipped))
        now = time.monotonic()
        current = self._view.roles.version
        if (
            self._acked is None
            or self._acked[0] != current
            or now - self._acked[1] >= self._heartbeat_s
        ):
            await asyncio.wait_for(
                self._source.ack_roles(self._router_id, current), self._timeout_s
            )
            self._acked = (current, now)

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
                if self._failing:
                    logger.warning("reading the roles from Redis works again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    logger.warning(
                        "reading the roles from Redis failed (%s: %s); routing by roles "
                        "version %d until it works",
                        type(exc).__name__,
                        exc,
                        self._view.roles.version,
                    )
                self._failing = True
            await asyncio.sleep(self._period_s)
