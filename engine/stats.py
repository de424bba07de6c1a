"""What a served engine reports each step, kept where pdserve can read it.

vLLM hands SchedulerStats to its stat loggers in the AsyncLLM process after engine steps;
`EngineStatsRecorder` keeps the latest queue and KV-cache figures and every KV transfer the
connector timed (NIXL's telemetry, and the `ray` connector's own), for metrics, autoscaling
signals and the transfer benchmark. `engine_stat_loggers` is what a served engine hands vLLM:
the recorder's logger, and vLLM's Ray exporter when the recorder has export labels
(engine/ray_metrics.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_TRANSFERS_KEPT = 10_000


@dataclass(frozen=True)
class TransferSample:
    seconds: float
    num_bytes: int


@dataclass(frozen=True)
class KVLoadCounts:
    """What a consumer engine's loads came to. A load fails when the engine computed more of the
    prompt than its last token (which vLLM always recomputes to get logits): the KV did not
    arrive, whatever the connector said, and the engine recomputed or refused the prompt."""

    num_loads: int = 0
    num_failures: int = 0
    num_recomputed_tokens: int = 0

    def minus(self, earlier: KVLoadCounts) -> KVLoadCounts:
        return KVLoadCounts(
            self.num_loads - earlier.num_loads,
            self.num_failures - earlier.num_failures,
            self.num_recomputed_tokens - earlier.num_recomputed_tokens,
        )


def num_recomputed_tokens(num_prompt_tokens: int, num_cached_tokens: int) -> int:
    """Prompt tokens a consumer computed itself beyond the last one. `num_cached_tokens` is
    vLLM's per-request count of prompt tokens it did not compute (loaded or prefix-cached)."""
    return max(0, num_prompt_tokens - 1 - num_cached_tokens)


@dataclass(frozen=True)
class SchedulerSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class EngineStatsRecorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The labels of vLLM's own metrics exported through Ray (app, pool); None: the engine
        # exports none (outside a Serve replica). Set before the engine starts.
        self.export_labels: Mapping[str, str] | None = None
        # vLLM's Ray stat loggers the engine built (engine/ray_metrics.py).
        self.exporters: list[Any] = []
        self.latest = SchedulerSnapshot()
        self.transfers: deque[TransferSample] = deque(maxlen=MAX_TRANSFERS_KEPT)
        self.num_failed_transfers = 0
        self.kv_loads = KVLoadCounts()

    def observe(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        snapshot = SchedulerSnapshot(
            num_running=int(getattr(scheduler_stats, "num_running_reqs", 0)),
            num_waiting=int(getattr(scheduler_stats, "num_waiting_reqs", 0)),
            kv_cache_usage=float(getattr(scheduler_stats, "kv_cache_usage", 0.0)),
        )
        connector: dict[str, Any] = getattr(scheduler_stats, "kv_connector_stats", None) or {}
        durations = connector.get("transfer_duration", [])
        sizes = connector.get("bytes_transferred", [])
        with self._lock:
            self.latest = snapshot
            for seconds, num_bytes in zip(durations, sizes, strict=False):
                self.transfers.append(TransferSample(float(seconds), int(num_bytes)))
            self.num_failed_transfers += len(connector.get("num_failed_transfers", []))

    def record_kv_load(self, num_prompt_tokens: int, num_cached_tokens: int, failed: bool) -> bool:
        """One consumer request's load: `failed` when the engine refused it (policy "fail").
        Returns whether the load failed (refused, or recomputed)."""
        recomputed = num_recomputed_tokens(num_prompt_tokens, num_cached_tokens)
        failed = failed or recomputed > 0
        with self._lock:
            self.kv_loads = KVLoadCounts(
                self.kv_loads.num_loads + 1,
                self.kv_loads.num_failures + int(failed),
                self.kv_loads.num_recomputed_tokens + recomputed,
            )
        return failed

    def refresh_exported_gauges(self) -> None:
        """Periodically (the replica's stats tick): keep an idle engine's exported queue and
        KV-usage gauges alive (engine/ray_metrics.py, `refresh_gauges`)."""
        for exporter in self.exporters:
            exporter.refresh_gauges()

    def take_transfers(self) -> list[TransferSample]:
        with self._lock:
            taken = list(self.transfers)
            self.transfers.clear()
        return taken


def stat_logger_factory(recorder: EngineStatsRecorder) -> Any:
    """A vLLM StatLoggerFactory whose loggers feed `recorder`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _RecorderLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            recorder.observe(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _RecorderLogger


def engine_stat_loggers(recorder: EngineStatsRecorder | None) -> list[Any] | None:
    """The stat logger factories an engine starts with (`AsyncLLM(stat_loggers=...)`)."""
    if recorder is None:
        return None
    loggers: list[Any] = [stat_logger_factory(recorder)]
    if recorder.export_labels is not None:
        from engine.ray_metrics import ray_stat_logger

        loggers.append(ray_stat_logger(recorder.export_labels, recorder.exporters.append))
    return loggers
