"""ColocatedEngine: one vLLM AsyncLLM serving both phases, no KV transfer, and its Serve
deployment `ColocatedServer`.

The baseline the disaggregated topology is measured against: the same engine settings, the
same TokenEvent stream (first token flagged with its prefill timings), one engine per replica.
A decode worker that prefills for itself, hence here (the target design lets every engine take
either role).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from engine.async_engine import ServedEngine, start_async_engine
from engine.intervals import in_intervals
from engine.messages import GenerationRequest, TokenEvent
from engine.settings import EngineSettings
from engine.token_wire import TokenRoute
from prefill_workers.replica import PendingPrefill, ReplicaSettings, ReplicaShell


class ColocatedEngine(ServedEngine):
    def __init__(self, settings: EngineSettings, worker_id: str | None = None) -> None:
        super().__init__(worker_id or f"engine-{uuid.uuid4().hex[:8]}")
        self.settings = settings

    def start(self) -> None:
        self.engine, self.start_seconds = start_async_engine(self.settings, recorder=self.stats)


class ColocatedServer(ReplicaShell):
    """The colocated topology's Serve deployment: one ColocatedEngine per replica."""

    pool = "engine"

    def __init__(self, settings: ReplicaSettings) -> None:
        self._engine = ColocatedEngine(settings.engine.resolve())
        self.start_engine(self._engine, settings.status)
        self._pending = PendingPrefill()
        self._stream_interval = settings.stream_interval

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._pending.num_tokens

    async def generate(
        self,
        request: GenerationRequest,
        avoid: tuple[str, ...] = (),
        route: TokenRoute | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """`avoid` is for the request router (replicas that failed this request); `route`: the
        router's token channel, which then takes the events (`ReplicaShell.delivered`)."""
        with self.failures_named():
            events = self._pending.counted(
                request.num_prompt_tokens, self._engine.generate(request)
            )
            stream = in_intervals(events, self._stream_interval)
            async for event in self.delivered(stream, route):
                yield event
