"""Starting a served engine: vLLM's AsyncLLM, with its EngineCore in child processes.

AsyncLLM cannot run in-process. On CPU its worker is a further child process, where
VLLM_CPU_OMP_THREADS_BIND (from EngineSettings.cpu_cores) pins the compute threads.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from engine.messages import GenerationRequest, ReplicaLoad, TokenEvent
from engine.sampling import logprobs_of, sampling_params_for
from engine.settings import EngineSettings
from engine.stats import EngineStatsRecorder, engine_stat_loggers

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


def start_async_engine(
    settings: EngineSettings,
    kv_transfer: KVTransferConfig | None = None,
    env: dict[str, str] | None = None,
    recorder: EngineStatsRecorder | None = None,
) -> tuple[Any, float]:
    """An AsyncLLM for `settings`, and how long it took to start (seconds). A sim engine
    (`settings.sim`) is a stand-in in this process: no KV connector, no child processes."""
    if settings.sim is not None:
        from engine.sim.engine import start_sim_engine

        return start_sim_engine(settings, recorder)
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    settings.apply_process_env()
    os.environ.update(env or {})
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        settings.async_engine_args(kv_transfer), stat_loggers=engine_stat_loggers(recorder)
    )
    return engine, time.perf_counter() - started


def engine_times(metrics: object, wall_s: float) -> tuple[float, float]:
    """(engine queue, prefill compute) seconds from vLLM's per-request stats, whose stamps are
    engine-core monotonic; the wall time of the call when vLLM reports none."""
    queued = getattr(metrics, "queued_ts", 0.0) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0
    if not (0 < queued <= scheduled <= first):
        return 0.0, wall_s
    return scheduled - queued, first - scheduled


async def kv_cache_is_empty(engine: Any) -> bool:
    """True when no request holds a KV block (the scheduler refuses a prefix-cache reset while
    any block is in use, so this is a strict, fresh check, not a sampled statistic)."""
    return bool(await engine.reset_prefix_cache())


async def _wait_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, poll_s: float
) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)


class ServedEngine:
    """One AsyncLLM owned by a worker: its id, stats, and the calls every worker shares.
    Subclasses build the engine in `start()` (with or without a KV connector)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.engine: Any = None
        self.start_seconds = 0.0
        self.stats = EngineStatsRecorder()

    def start(self) -> None:
        """Build and start `self.engine` (blocking: 25-45 s per engine on CPU)."""
        raise NotImplementedError

    def load(self, pool: str, num_pending_prefill_tokens: int = 0) -> ReplicaLoad:
        """This engine's load now, from its stat logger's latest step and its KV capacity."""
        latest, loads = self.stats.latest, self.stats.kv_loads
        total = int(self.engine.vllm_config.cache_config.num_gpu_blocks or 0)
        kv_usage = min(1.0, max(0.0, latest.kv_cache_usage))
        return ReplicaLoad(
            replica_id=self.worker_id,
            pool=pool,
            num_pending_prefill_tokens=num_pending_prefill_tokens,
            num_running=latest.num_running,
            num_waiting=latest.num_waiting,
            kv_usage=kv_usage,
            num_total_blocks=total,
            num_free_blocks=max(0, total - round(total * kv_usage)),
            updated_at=time.time(),
            num_kv_loads=loads.num_loads,
            num_kv_load_failures=loads.num_failures,
            num_kv_recomputed_tokens=loads.num_recomputed_tokens,
            is_healthy=not self.engine.errored,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The whole request on this engine, prefill and decode, no KV transfer: the colocated
        topology's call, and a decode engine's when the router has it prefill for itself. The
        first event carries the first token and its prefill timings."""
        request = request.with_pinned_seed()
        sampling = sampling_params_for(self.engine, request.params, served=True)
        started = time.perf_counter()
        first_sent = False
        async for output in self.engine.generate(
            {"prompt_token_ids": list(request.prompt_token_ids)}, sampling, request.request_id
        ):
            completion = output.outputs[0]
            new_ids = tuple(int(t) for t in completion.token_ids)  # delta outputs: the new ids
            logprobs = logprobs_of(completion, request.params)
            if not new_ids and completion.finish_reason is None:
                continue
            if not first_sent and new_ids:
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
                first_sent = True
                new_ids = new_ids[1:]
                logprobs = logprobs[1:] if logprobs is not None else None
                if not new_ids and first.finish_reason is not None:
                    return
                if not new_ids and completion.finish_reason is None:
                    continue
            yield TokenEvent(new_ids, completion.finish_reason, logprobs=logprobs)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def is_idle(self) -> bool:
        """True when the engine holds no KV block (strict, fresh; see kv_cache_is_empty)."""
        return await kv_cache_is_empty(self.engine)

    async def is_drained(self) -> bool:
        """True when nothing still depends on this engine's process staying up: here, that it
        holds no KV block (a producer adds the handoffs it stored elsewhere)."""
        return await self.is_idle()

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """True once the engine holds no KV block; False when `timeout_s` passed first (frees
        lag a step, and a prefill engine holds a handoff's blocks until they are pulled or its
        lease expires)."""
        return await _wait_until(self.is_idle, timeout_s, poll_s)

    async def wait_drained(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """`wait_idle` for `is_drained`: what a stopping replica waits for."""
        return await _wait_until(self.is_drained, timeout_s, poll_s)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
