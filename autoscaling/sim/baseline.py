"""The comparison point: Ray Serve's default request-based policy, applied per pool.

target = ceil(ongoing requests / target_ongoing_requests), taken once the wish has held for
`upscale_delay_s` (up) or `downscale_delay_s` (down). Defaults are Ray Serve's (30 s / 600 s,
2 ongoing requests per replica); decode sets its own target because a decode replica batches.
It returns the same `Decision` as our policy, so the simulator runs either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaling.config import DEFAULT_BOUNDS
from autoscaling.history import ScaleEvent, ScalingHistory
from autoscaling.policy import Decision
from autoscaling.signals import DecodeSignals, PrefillSignals
from autoscaling.sim.pool_policies import PoolPolicies
from control.records import ReplicaBounds


@dataclass(frozen=True)
class QueueLengthConfig:
    """Ray Serve's `AutoscalingConfig` defaults, for one pool."""

    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    def __post_init__(self) -> None:
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("delays must be >= 0")


PREFILL_QUEUE_LENGTH = QueueLengthConfig()
DECODE_QUEUE_LENGTH = QueueLengthConfig(target_ongoing_requests=16.0)


def ongoing_requests(signals: PrefillSignals | DecodeSignals) -> int:
    if isinstance(signals, PrefillSignals):
        return signals.num_ongoing_requests
    return signals.num_running + signals.num_waiting


def decide_queue_length(
    signals: PrefillSignals | DecodeSignals,
    config: QueueLengthConfig,
    bounds: ReplicaBounds,
    history: ScalingHistory,
    now_s: float,
) -> Decision:
    current = signals.num_target
    ongoing = ongoing_requests(signals)
    desired = bounds.clamp(math.ceil(ongoing / config.target_ongoing_requests))
    history = history.with_timers(now_s, breach=desired > current, calm=desired < current)
    target, reason = current, f"hold: {ongoing} ongoing requests"
    up_since, down_since = history.breach_since_s, history.calm_since_s
    if up_since is not None and now_s - up_since >= config.upscale_delay_s:
        target, reason = desired, f"up: {ongoing} ongoing requests"
    elif down_since is not None and now_s - down_since >= config.downscale_delay_s:
        target, reason = desired, f"down: {ongoing} ongoing requests"
    if target != current:
        history = history.with_event(ScaleEvent(now_s, current, target, reason), 16)
    return Decision(target, current, reason, signals, None, history)


def queue_length_policies(
    prefill_config: QueueLengthConfig = PREFILL_QUEUE_LENGTH,
    decode_config: QueueLengthConfig = DECODE_QUEUE_LENGTH,
    prefill_bounds: ReplicaBounds = DEFAULT_BOUNDS,
    decode_bounds: ReplicaBounds = DEFAULT_BOUNDS,
) -> PoolPolicies:
    """The baseline for both pools, in the simulator's shape."""

    def prefill(signals: PrefillSignals, history: ScalingHistory, now_s: float) -> Decision:
        return decide_queue_length(signals, prefill_config, prefill_bounds, history, now_s)

    def decode(signals: DecodeSignals, history: ScalingHistory, now_s: float) -> Decision:
        return decide_queue_length(signals, decode_config, decode_bounds, history, now_s)

    return PoolPolicies("queue-length", prefill, decode)
