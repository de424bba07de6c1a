"""ColocatedEngine: one vLLM AsyncLLM serving both phases, no KV transfer, and its Serve
deployment `ColocatedServer`.

The baseline the disaggregated topology is measured against: the same engine settings, the
same TokenEvent stream (first token flagged with its prefill timings), one engine per replica.
A decode worker that prefills for itself, hence here (the target design lets every engine take
either role).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from engine.async_engine import ServedEngine, engine_times, start_async_engine
from engine.messages import GenerationRequest, TokenEvent
from engine.sampling import logprobs_of, to_sampling_params
from engine.settings import EngineSettings
from prefill_workers.replica import ReplicaSettings, ReplicaShell


class ColocatedEngine(ServedEngine):
    def __init__(self, settings: EngineSettings, worker_id: str | None = None) -> None:
        super().__init__(worker_id or f"engine-{uuid.uuid4().hex[:8]}")
        self.settings = settings

    def start(self) -> None:
        self.engine, self.start_seconds = start_async_engine(self.settings, recorder=self.stats)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        request = request.with_pinned_seed()
        sampling = to_sampling_params(request.params, served=True)
        started = time.perf_counter()
        num_seen = 0
        async for output in self.engine.generate(
            {"prompt_token_ids": list(request.prompt_token_ids)}, sampling, request.request_id
        ):
            completion = output.outputs[0]
            new_ids = tuple(int(t) for t in completion.token_ids)  # delta outputs: the new ids
            logprobs = logprobs_of(completion, request.params)
            if not new_ids and completion.finish_reason is None:
                continue
            if num_seen == 0 and new_ids:
                _, compute_s = engine_times(output.metrics, time.perf_counter() - started)
                first = TokenEvent(
                    new_ids[:1],
                    completion.finish_reason if len(new_ids) == 1 else None,
                    is_first=True,
                    prefill_seconds=compute_s,
                    replica_id=self.worker_id,
                    logprobs=logprobs[:1] if logprobs is not None else None,
                )
                yield first
                num_seen = 1
                new_ids = new_ids[1:]
                logprobs = logprobs[1:] if logprobs is not None else None
                if not new_ids and first.finish_reason is not None:
                    return
                if not new_ids and completion.finish_reason is None:
                    continue
            num_seen += len(new_ids)
            yield TokenEvent(new_ids, completion.finish_reason, logprobs=logprobs)


class ColocatedServer(ReplicaShell):
    """The colocated topology's Serve deployment: one ColocatedEngine per replica."""

    pool = "engine"

    def __init__(self, settings: ReplicaSettings) -> None:
        self._engine = ColocatedEngine(settings.engine.resolve())
        self.start_engine(self._engine, settings.status)
        self._pending_tokens = 0

    @property
    def num_pending_prefill_tokens(self) -> int:
        return self._pending_tokens

    async def generate(
        self, request: GenerationRequest, avoid: tuple[str, ...] = ()
    ) -> AsyncIterator[TokenEvent]:
        """`avoid` is for the request router (replicas that failed this request)."""
        self._pending_tokens += request.num_prompt_tokens
        prefilled = False
        try:
            with self.failures_named():
                async for event in self._engine.generate(request):
                    if event.is_first:
                        prefilled = True
                        self._pending_tokens -= request.num_prompt_tokens
                    yield event
        finally:
            if not prefilled:
                self._pending_tokens -= request.num_prompt_tokens
