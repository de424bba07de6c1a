"""What every engine replica of the Serve app shares: its id, health, load figures for the
request router (`record_routing_stats`) and the status it publishes to the control plane.

The figures come from the engine's stat logger (queue, KV usage) and from the replica's own
count of prompt tokens it has accepted but not yet prefilled.
"""

from __future__ import annotations

import time
from typing import Any

from engine.stats import EngineStatsRecorder


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
    _num_pending_prefill_tokens: int = 0

    def num_total_blocks(self) -> int:
        engine = self._engine_owner.engine
        return int(engine.vllm_config.cache_config.num_gpu_blocks or 0)

    def routing_snapshot(self) -> dict[str, Any]:
        latest = self._stats.latest
        total = self.num_total_blocks()
        used = round(total * latest.kv_cache_usage)
        return {
            "pool": self.pool,
            "replica_id": self._engine_owner.worker_id,
            "pending_prefill_tokens": self._num_pending_prefill_tokens,
            "num_running": latest.num_running,
            "num_waiting": latest.num_waiting,
            "kv_usage": latest.kv_cache_usage,
            "num_total_blocks": total,
            "num_free_blocks": max(0, total - used),
            "updated_at": time.time(),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every `request_routing_stats_period_s`; read by the request router."""
        return self.routing_snapshot()

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
