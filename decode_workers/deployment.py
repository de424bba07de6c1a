"""DecodeServer: the decode pool's Serve deployment, one DecodeWorker per replica."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from decode_workers.worker import DecodeWorker
from deploy.config import AppConfig
from deploy.engines import engine_settings, served_transfer_settings
from engine.autoscaling_stats import DecodeWindow
from engine.messages import GenerationRequest, KVHandoff, TokenEvent
from engine.replica import ReplicaShell
from router.metrics import TransferMetrics


class DecodeServer(ReplicaShell):
    pool = "decode"

    def __init__(self, config: AppConfig) -> None:
        worker = DecodeWorker(engine_settings(config, "decode"), served_transfer_settings(config))
        self.start_engine(worker, config.control.redis_url, config.name)
        self._transfer_metrics = TransferMetrics(config.name, worker.backend.name)
        self._window = DecodeWindow(config.autoscaling.window_s, config.autoscaling.percentile)

    def on_stats_tick(self) -> None:
        # Periodic (routing-stats period): export the KV transfers made since the last tick.
        self._transfer_metrics.observe(self._stats.take_transfers())

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff
    ) -> AsyncIterator[TokenEvent]:
        # TPOT of this request on this replica: from its first decoded token to its last.
        first_at = last_at = 0.0
        num_tokens = 0
        async for chunk in self._engine_owner.decode(request, handoff):
            if chunk.token_ids:
                last_at = time.perf_counter()
                first_at = first_at or last_at
                num_tokens += len(chunk.token_ids)
            yield chunk
        if num_tokens > 1:
            self._window.record_tpot((last_at - first_at) / (num_tokens - 1))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to the Serve controller for the decode pool's SLO policy."""
        latest = self._stats.latest
        return self._window.report(latest.num_running, latest.num_waiting, latest.kv_cache_usage)

    async def release(self, handoff: KVHandoff) -> None:
        await self._engine_owner.release(handoff)
