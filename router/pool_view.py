"""What the request routers in this process last saw of each engine pool, for the per-request
prefill decision (router/pd_decision.py).

Serve runs a deployment handle's request router in the process that holds the handle: the
Router replica's. So the prefill and decode routers (router/replica_router.py) leave each
routing call's replica loads here, and the Router reads them when it decides where a new
request's prompt is computed. One view per process (`POOL_VIEW`): Serve builds the request
routers itself, from keyword arguments, and gives them no other way to reach the Router.

Trap: Serve registers the request router's module for pickling by value
(`cloudpickle.register_pickle_by_value`) and unpickles it into each handle's router, so a name
imported into that module is a copy per unpickling. router/replica_router.py reaches the view
through this module (`pool_view.POOL_VIEW`), which pickles by reference: measured, the direct
import left the Router with an empty view while the routers each filled a copy of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from control.keys import POOLS
from control.records import RoleTable
from engine.messages import ReplicaLoad
from prefill_workers.replica import unique_id_of
from router.pd_decision import PoolSnapshot
from router.prefix import PrefixLookup, block_hashes
from router.roles import pool_for, serving


class PoolView:
    """`clock` is unix seconds: a snapshot's age is counted from when its replica made the
    report (`ReplicaLoad.updated_at`), which a routing call may see a period later."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._loads: dict[str, tuple[ReplicaLoad, ...]] = {}
        self._prefix: tuple[PrefixLookup, int] | None = None
        self._roles = RoleTable()

    @property
    def roles(self) -> RoleTable:
        """Which pool's calls each replica takes (router/roles.py keeps it current)."""
        return self._roles

    def set_roles(self, table: RoleTable) -> None:
        self._roles = table

    def pool_for(self, role: str) -> str:
        """The KV pool whose handle a call of `role` goes through now."""
        return pool_for(role, self._roles, self._loads)

    @property
    def loads(self) -> dict[str, tuple[ReplicaLoad, ...]]:
        """Each pool's last seen loads."""
        return dict(self._loads)

    def knows(self, pool: str) -> bool:
        """Whether any load of `pool` was seen (an empty report counts as seen)."""
        return pool in self._loads

    def serves_none(self, role: str) -> bool:
        """Known: both pools' loads were seen and no replica of either takes `role`'s calls
        (not known until then: a pool not yet called has not been seen)."""
        return all(self.knows(pool) for pool in POOLS) and not serving(
            role, self._roles, self._loads
        )

    def update(self, pool: str, loads: Iterable[ReplicaLoad | None]) -> None:
        """A routing call's loads of `pool`'s replicas (those that reported, and are healthy)."""
        self._loads[pool] = tuple(load for load in loads if load is not None and load.is_healthy)

    def use_prefix_index(self, index: PrefixLookup, block_size: int) -> None:
        """The prefill router's own prefix records (what it routed itself)."""
        self._prefix = (index, block_size)

    def prefill(self, prompt_token_ids: Sequence[int]) -> tuple[PoolSnapshot | None, int]:
        """The prefill replica the prompt would most likely go to, and the prompt tokens it
        holds already: the one holding the prompt's longest prefix, else the least pending.
        Replicas of either pool that take prefill calls now (role flips) count."""
        loads = serving("prefill", self._roles, self._loads)
        if not loads:
            return None, 0
        by_id = {unique_id_of(load.replica_id): load for load in loads}
        if self._prefix is not None:
            index, block_size = self._prefix
            hashes = block_hashes(prompt_token_ids, block_size)
            match = index.longest_prefix_match(hashes, by_id.keys()) if hashes else None
            if match is not None and match.replica is not None:
                owner = by_id[match.replica]
                return self._snapshot(owner), match.num_blocks * block_size
        least = min(loads, key=lambda load: load.num_pending_prefill_tokens)
        return self._snapshot(least), 0

    def decode(self) -> PoolSnapshot | None:
        """The decode replica a request would most likely go to: the most free KV blocks."""
        loads = serving("decode", self._roles, self._loads)
        if not loads:
            return None
        best = max(loads, key=lambda load: (load.num_free_blocks, -load.num_running))
        return self._snapshot(best)

    def _snapshot(self, load: ReplicaLoad) -> PoolSnapshot:
        age_s = max(0.0, self._clock() - load.updated_at)
        return PoolSnapshot(load.num_pending_prefill_tokens, load.num_running, age_s)


POOL_VIEW = PoolView()
