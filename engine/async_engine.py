"""Starting a served engine: vLLM's AsyncLLM, with its EngineCore in child processes.

AsyncLLM cannot run in-process. On CPU its worker is a further child process, where
VLLM_CPU_OMP_THREADS_BIND (from EngineSettings.cpu_cores) pins the compute threads.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from engine.settings import EngineSettings
from engine.stats import EngineStatsRecorder, stat_logger_factory

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


def start_async_engine(
    settings: EngineSettings,
    kv_transfer: KVTransferConfig | None = None,
    env: dict[str, str] | None = None,
    recorder: EngineStatsRecorder | None = None,
) -> tuple[Any, float]:
    """An AsyncLLM for `settings`, and how long it took to start (seconds)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    settings.apply_process_env()
    os.environ.update(env or {})
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        settings.async_engine_args(kv_transfer),
        stat_loggers=[stat_logger_factory(recorder)] if recorder is not None else None,
    )
    return engine, time.perf_counter() - started


async def kv_cache_is_empty(engine: Any) -> bool:
    """True when no request holds a KV block (the scheduler refuses a prefix-cache reset while
    any block is in use, so this is a strict, fresh check, not a sampled statistic)."""
    return bool(await engine.reset_prefix_cache())


class ServedEngine:
    """One AsyncLLM owned by a worker: its id, stats, and the calls every worker shares.
    Subclasses build the engine in `start()` (with or without a KV connector)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.engine: Any = None
        self.start_seconds = 0.0
        self.stats = EngineStatsRecorder()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def is_idle(self) -> bool:
        """True when the engine holds no KV block (strict, fresh; see kv_cache_is_empty)."""
        return await kv_cache_is_empty(self.engine)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
