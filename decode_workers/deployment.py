"""DecodeServer: the decode pool's Serve deployment, one DecodeWorker per replica."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from decode_workers.metrics import TransferMetrics
from decode_workers.worker import DecodeWorker
from engine.autoscaling_stats import DecodeWindow
from engine.intervals import in_intervals
from engine.messages import GenerationRequest, KVHandoff, TokenEvent
from engine.stats import KVLoadCounts
from kv_transfer.endpoint import served_transfer_settings
from prefill_workers.replica import PendingPrefill, ReplicaSettings, ReplicaShell


class DecodeServer(ReplicaShell):
    pool = "decode"

    def __init__(self, settings: ReplicaSettings) -> None:
        transfer = served_transfer_settings(settings.require_transfer())
        self._worker = DecodeWorker(settings.engine.resolve(), transfer)
        self.start_engine(self._worker, settings.status)
        self._transfer_metrics = TransferMetrics(settings.app, self._worker.backend.name)
        self._window = DecodeWindow(settings.window_s, settings.percentile)
        self._pending = PendingPrefill()  # the requests it prefills for itself
        self._stream_interval = settings.stream_interval

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._pending.num_tokens

    def on_stats_tick(self) -> None:
        # Periodic (routing-stats period): export the KV transfers and loads since the last tick.
        self._transfer_metrics.observe(self._worker.stats.take_transfers())
        self._transfer_metrics.observe_loads(self._worker.stats.kv_loads)

    async def decode(
        self, request: GenerationRequest, handoff: KVHandoff, avoid: tuple[str, ...] = ()
    ) -> AsyncIterator[TokenEvent]:
        """`avoid` is for the request router (replicas that failed this request)."""
        events = self._timed(self._worker.decode(request, handoff))
        async for event in in_intervals(events, self._stream_interval):
            yield event

    async def generate(
        self, request: GenerationRequest, avoid: tuple[str, ...] = ()
    ) -> AsyncIterator[TokenEvent]:
        """The whole request here, prefill included (the router's choice when no prefill
        replica could take it); the first event carries the first token."""
        events = self._pending.counted(request.num_prompt_tokens, self._worker.generate(request))
        async for event in in_intervals(self._timed(events), self._stream_interval):
            yield event

    async def _timed(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        # TPOT of this request on this replica: from its first decoded token to its last.
        first_at = last_at = 0.0
        num_tokens = 0
        with self.failures_named():
            async for event in events:
                if event.token_ids and not event.is_first:
                    last_at = time.perf_counter()
                    first_at = first_at or last_at
                    num_tokens += len(event.token_ids)
                yield event
        if num_tokens > 1:
            self._window.record_tpot((last_at - first_at) / (num_tokens - 1))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to the Serve controller for the decode pool's SLO policy."""
        latest = self._worker.stats.latest
        return self._window.report(latest.num_running, latest.num_waiting, latest.kv_cache_usage)

    def kv_loads(self) -> KVLoadCounts:
        """What this replica's KV loads came to so far (tests, and what status shows)."""
        return self._worker.stats.kv_loads

    async def release(self, handoff: KVHandoff) -> None:
        await self._worker.release(handoff)
