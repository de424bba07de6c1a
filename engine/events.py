"""What an engine stream hands the router: tokens, and the timings only the engine knows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    finish_reason: str | None
    # The first token, streamed as soon as prefill is done (TTFT ends here).
    is_first: bool = False
    # On the first event: engine compute for the prompt, and the engine-queue wait before it.
    prefill_seconds: float = 0.0
    engine_queue_seconds: float = 0.0
    # An empty event sent just before the decode pool is called (disaggregated only).
    is_decode_start: bool = False

    @property
    def from_prefill(self) -> bool:
        return self.is_first


def engine_times(metrics: object, wall_s: float) -> tuple[float, float]:
    """(engine queue, prefill compute) seconds from vLLM's per-request stats, whose stamps are
    engine-core monotonic; the wall time of the call when vLLM reports none."""
    queued = getattr(metrics, "queued_ts", 0.0) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    first = getattr(metrics, "first_token_ts", 0.0) or 0.0
    if not (0 < queued <= scheduled <= first):
        return 0.0, wall_s
    return scheduled - queued, first - scheduled
