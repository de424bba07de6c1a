"""A policy for each pool, in the shape the simulator calls every tick."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoscaling.config import DEFAULT_BOUNDS, DEFAULT_CONFIG, AutoscalingConfig
from autoscaling.history import ScalingHistory
from autoscaling.policy import Decision, decide_decode, decide_prefill
from autoscaling.signals import DecodeSignals, PrefillSignals
from control.records import PoolSLO, ReplicaBounds

PrefillPolicy = Callable[[PrefillSignals, ScalingHistory, float], Decision]
DecodePolicy = Callable[[DecodeSignals, ScalingHistory, float], Decision]


@dataclass(frozen=True)
class PoolPolicies:
    name: str
    prefill: PrefillPolicy
    decode: DecodePolicy


def slo_policies(
    slo: PoolSLO,
    prefill_bounds: ReplicaBounds = DEFAULT_BOUNDS,
    decode_bounds: ReplicaBounds = DEFAULT_BOUNDS,
    config: AutoscalingConfig = DEFAULT_CONFIG,
    prefill_pin: int | None = None,
    decode_pin: int | None = None,
) -> PoolPolicies:
    """Our policy, both pools, with fixed SLOs, bounds and pins."""

    def prefill(signals: PrefillSignals, history: ScalingHistory, now_s: float) -> Decision:
        return decide_prefill(signals, slo, prefill_bounds, prefill_pin, history, now_s, config)

    def decode(signals: DecodeSignals, history: ScalingHistory, now_s: float) -> Decision:
        return decide_decode(signals, slo, decode_bounds, decode_pin, history, now_s, config)

    return PoolPolicies("slo", prefill, decode)
