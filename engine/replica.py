"""What every engine replica of the Serve app shares: its id, health, load figures for the
request router (`record_routing_stats`) and the status it publishes to the control plane.

The figures come from the engine's stat logger (queue, KV usage) and from the replica's own
count of prompt tokens it has accepted but not yet prefilled.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.messages import ReplicaLoad
from engine.stats import EngineStatsRecorder

logger = logging.getLogger(__name__)


def serve_replica_id(default: str) -> str:
    """The Serve replica's unique id (what the request router sees), or `default` outside Serve."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a Serve replica (engine tests)
        return default


class ReplicaShell:
    """Mixin for a deployment class holding one engine in `self._engine_owner`."""

    pool: str
    _engine_owner: Any
    _stats: EngineStatsRecorder
    _store: Any = None

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt tokens accepted and not yet prefilled (0 for a pool that never prefills)."""
        return 0

    def start_engine(self, owner: Any, redis_url: str | None, app: str) -> None:
        """Name `owner` after this Serve replica (what the request router sees), start its
        engine, and connect the control plane: what every engine deployment does first."""
        owner.worker_id = f"{self.pool}-{serve_replica_id(owner.worker_id)}"
        owner.start()
        self._engine_owner = owner
        self._stats = owner.stats
        self.connect_control_plane(redis_url, app)

    def connect_control_plane(self, redis_url: str | None, app: str) -> None:
        """Publish this replica's status to the app's Redis (what `pdserve status` lists)."""
        self._store = None
        if redis_url:
            from control.store import ControlStore

            self._store = ControlStore.from_url(redis_url, app)

    def on_stats_tick(self) -> None:
        """Hook run on each routing-stats period (decode exports its KV transfer metrics)."""

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every `request_routing_stats_period_s`; read by the request router."""
        self.on_stats_tick()
        load = self._engine_owner.load(self.pool, self.num_pending_prefill_tokens)
        if getattr(self, "_store", None) is not None and self.pool in ("prefill", "decode"):
            await self._publish(load)
        return load.to_stats()

    async def _publish(self, load: ReplicaLoad) -> None:
        try:
            await self._store.put_replica_load(load)
        except Exception as exc:  # status is informational; routing and serving go on
            logger.warning("publishing replica status to Redis failed: %s", exc)

    async def check_health(self) -> None:
        """Serve's health probe: a dead EngineCore marks the replica unhealthy and replaces it."""
        await self._engine_owner.engine.check_health()

    async def is_idle(self) -> bool:
        """True when the engine holds no KV block (strict: a prefix-cache reset succeeds)."""
        return bool(await self._engine_owner.is_idle())

    async def abort(self, request_id: str) -> None:
        await self._engine_owner.abort(request_id)

    def __del__(self) -> None:
        owner = getattr(self, "_engine_owner", None)
        if owner is not None:
            owner.shutdown()
