"""The KV pools' Serve deployments: `PrefillServer` (the prefill pool) and `DecodeServer` (the
decode pool), one EngineWorker (KV role "both") per replica.

A replica of either pool takes every call: `prefill` (produce a handoff), `decode` (consume
one), `generate` (the whole request, prefill included). Which calls it gets is the router's
choice: its home pool's by default, the other pool's after a role flip (router/roles.py).
The pool a replica belongs to is what Serve scales and what its autoscaling stats report on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import ClassVar

from decode_workers.metrics import TransferMetrics
from decode_workers.worker import EngineWorker
from engine.autoscaling_stats import (
    LOCAL_PREFILL_STEP_P95_S,
    PREFILL_STEP_P95_S,
    DecodeWindow,
    PrefillWindow,
)
from engine.intervals import in_intervals
from engine.messages import GenerationRequest, KVHandoff, PrefillResult, TokenEvent
from engine.stats import KVLoadCounts
from engine.token_wire import TokenRoute
from kv_transfer.endpoint import served_transfer_settings
from prefill_workers.replica import ReplicaSettings, ReplicaShell


class EngineServer(ReplicaShell):
    pool: ClassVar[str]

    def __init__(self, settings: ReplicaSettings) -> None:
        transfer = served_transfer_settings(settings.require_transfer())
        # Its handoffs' KV lives until pulled or until their lease ends: a stopping replica
        # that prefilled for others keeps serving those pulls as long.
        self.drain_timeout_s = transfer.lease_seconds
        engine = settings.engine.resolve()
        self._worker = EngineWorker(engine, transfer)
        self.start_engine(self._worker, settings.status)
        self._transfer_metrics = TransferMetrics(settings.app, self._worker.backend.name)
        chunk = engine.chunk_budget
        self._prefill_window = PrefillWindow(
            settings.window_s, settings.percentile, chunk_tokens=chunk
        )
        self._decode_window = DecodeWindow(settings.window_s, settings.percentile)
        # The prompts it computes for itself (`generate`): their pending tokens and compute.
        self._local_window = PrefillWindow(
            settings.window_s, settings.percentile, chunk_tokens=chunk
        )
        self._stream_interval = settings.stream_interval

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._prefill_window.num_pending_tokens + self._local_window.num_pending_tokens

    def on_stats_tick(self) -> None:
        # Periodic (routing-stats period): export the KV transfers and loads since the last tick.
        self._transfer_metrics.observe(self._worker.stats.take_transfers())
        self._transfer_metrics.observe_loads(self._worker.stats.kv_loads)

    async def prefill(
        self, request: GenerationRequest, avoid: tuple[str, ...] = ()
    ) -> PrefillResult:
        """The prompt's first token and its KV's handoff. `avoid` is for the request router
        (replicas that failed this request)."""
        token = self._prefill_window.request_started(request.num_prompt_tokens)
        try:
            with self.failures_named():
                result = await self._worker.prefill(request)
        except BaseException:  # cancelled too: its tokens must not stay pending
            self._prefill_window.request_aborted(token)
            raise
        self._prefill_window.request_finished(
            token, queue_wait_s=result.engine_queue_seconds, compute_s=result.prefill_seconds
        )
        return result

    async def decode(
        self,
        request: GenerationRequest,
        handoff: KVHandoff,
        avoid: tuple[str, ...] = (),
        route: TokenRoute | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """The tokens after the handoff's first. `avoid` is for the request router; `route`:
        the router's token channel, which then takes the events (`ReplicaShell.delivered`)."""
        events = self._timed(self._worker.decode(request, handoff))
        stream = in_intervals(events, self._stream_interval)
        async for event in self.delivered(stream, route):
            yield event

    async def generate(
        self,
        request: GenerationRequest,
        avoid: tuple[str, ...] = (),
        route: TokenRoute | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """The whole request here, prefill included (the router's choice of local prefill, or
        when no prefill replica could take it); the first event carries the first token."""
        events = self._local_prefill(request.num_prompt_tokens, self._worker.generate(request))
        stream = in_intervals(self._timed(events), self._stream_interval)
        async for event in self.delivered(stream, route):
            yield event

    async def _local_prefill(
        self, num_tokens: int, events: AsyncIterator[TokenEvent]
    ) -> AsyncIterator[TokenEvent]:
        """`events`, with the prompt counted in the local window: pending until the first
        event, then its compute time (aborted when the stream ends without one)."""
        token: int | None = self._local_window.request_started(num_tokens)
        try:
            async for event in events:
                if token is not None and event.is_first:
                    self._local_window.request_finished(
                        token, queue_wait_s=0.0, compute_s=max(event.prefill_seconds, 0.0)
                    )
                    token = None
                yield event
        finally:
            if token is not None:
                self._local_window.request_aborted(token)

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
            self._decode_window.record_tpot((last_at - first_at) / (num_tokens - 1))

    def kv_loads(self) -> KVLoadCounts:
        """What this replica's KV loads came to so far (tests, and what status shows)."""
        return self._worker.stats.kv_loads

    async def release(self, handoff: KVHandoff) -> None:
        await self._worker.release(handoff)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to the Serve controller for its pool's SLO policy: both windows, whatever
        calls the engine takes, so a policy also sees what its engines do for the other role
        (the split follows the work: autoscaling/roles.py)."""
        latest = self._worker.stats.latest
        local = self._local_window.report()[PREFILL_STEP_P95_S]
        return (
            self._prefill_window.report()
            | self._decode_window.report(
                latest.num_running, latest.num_waiting, latest.kv_cache_usage
            )
            | {LOCAL_PREFILL_STEP_P95_S: local}
        )


class PrefillServer(EngineServer):
    pool = "prefill"


class DecodeServer(EngineServer):
    pool = "decode"
