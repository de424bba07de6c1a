"""DecodeServer: the decode pool's Serve deployment, one DecodeWorker per replica."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from decode_workers.worker import DecodeChunk, DecodeWorker
from deploy.config import AppConfig
from deploy.engines import engine_settings, served_transfer_settings
from engine.replica import ReplicaShell, serve_replica_id
from engine.request import GenerationRequest
from kv_transfer.handoff import KVHandoff
from router.metrics import TransferMetrics


class DecodeServer(ReplicaShell):
    pool = "decode"

    def __init__(self, config: AppConfig) -> None:
        worker = DecodeWorker(engine_settings(config, "decode"), served_transfer_settings(config))
        worker.worker_id = f"decode-{serve_replica_id(worker.worker_id)}"
        worker.start()
        self._engine_owner = worker
        self._stats = worker.stats
        self._transfer_metrics = TransferMetrics(config.name, worker.backend.name)

    def record_routing_stats(self) -> dict[str, Any]:
        # Serve calls this periodically: also the moment to export the transfers since the last.
        self._transfer_metrics.observe(self._stats.take_transfers())
        return self.routing_snapshot()

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff
    ) -> AsyncIterator[DecodeChunk]:
        async for chunk in self._engine_owner.decode(request, handoff):
            yield chunk

    async def release(self, handoff: KVHandoff) -> None:
        await self._engine_owner.release(handoff)
