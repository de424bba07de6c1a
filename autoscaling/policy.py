"""The scale decisions: prefill on TTFT, decode on TPOT and KV-cache usage. Pure functions.

Each tick the shell calls `decide_prefill` / `decide_decode` with the pool's aggregated signals
and the history the previous call returned; it applies `Decision.target_replicas` and keeps
`Decision.history` for the next call. Order of precedence:

1. an operator pin sets the target (clamped into the bounds, and the reason says so);
2. a current target outside the bounds is brought inside them;
3. a breach (observed or predicted) scales up, sized to bring the predicted value under
   `slo_headroom` x SLO, at most `max_upscale_factor` x current, no sooner than
   `upscale_cooldown_s` after the last scale-up;
4. a calm pool (every margin held for `downscale_delay_s`, `downscale_cooldown_s` after the
   last scale event) scales down by one;
5. otherwise hold.

A P95 taken within `window_s` of a scale-up still holds samples from before it, so it can start
a scale-up only once that window has passed; the queue predictor and KV usage, which describe
the present, can fire at any tick.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autoscaling.config import DEFAULT_CONFIG, AutoscalingConfig
from autoscaling.history import ScaleEvent, ScalingHistory, held_since
from autoscaling.signals import DecodeSignals, PrefillSignals
from control.records import PoolSLO, ReplicaBounds


class Decision(NamedTuple):
    """A pool's new target, why, the inputs that drove it, and the history to pass back."""

    target_replicas: int
    current_replicas: int
    reason: str
    inputs: PrefillSignals | DecodeSignals
    # Prefill: TTFT a request arriving now would see (queue drain + its own service). None
    # before any replica has measured its speed. Decode: None.
    predicted_ttft_s: float | None
    history: ScalingHistory

    @property
    def is_scale_event(self) -> bool:
        return self.target_replicas != self.current_replicas


class Assessment(NamedTuple):
    """What a pool's signals say, before pins, bounds and cool-downs are applied."""

    wanted_replicas: int | None  # None: no breach
    breach_reason: str
    is_calm: bool
    calm_reason: str
    has_waiting: bool = False


def decide_prefill(
    signals: PrefillSignals,
    slo: PoolSLO,
    bounds: ReplicaBounds,
    pin: int | None,
    history: ScalingHistory,
    now_s: float,
    config: AutoscalingConfig = DEFAULT_CONFIG,
) -> Decision:
    predicted = predict_ttft(signals)
    assessment = assess_prefill(signals, slo, predicted, history, now_s, config)
    return _decide(signals, assessment, bounds, pin, history, now_s, config, predicted)


def decide_decode(
    signals: DecodeSignals,
    slo: PoolSLO,
    bounds: ReplicaBounds,
    pin: int | None,
    history: ScalingHistory,
    now_s: float,
    config: AutoscalingConfig = DEFAULT_CONFIG,
) -> Decision:
    assessment = assess_decode(signals, slo, history, now_s, config)
    return _decide(signals, assessment, bounds, pin, history, now_s, config, None)


def predict_ttft(signals: PrefillSignals) -> float | None:
    """Drain time of the pending tokens over the pool, plus the measured service part of TTFT."""
    if signals.num_pending_tokens == 0:
        return _service_s(signals)
    if signals.num_target == 0:
        return math.inf
    if signals.prefill_tokens_per_s <= 0:
        return None
    drain_s = signals.num_pending_tokens / (signals.prefill_tokens_per_s * signals.num_target)
    return drain_s + (_service_s(signals) or 0.0)


def _service_s(signals: PrefillSignals) -> float | None:
    if signals.ttft_p95_s is None or signals.queue_wait_p95_s is None:
        return None
    return max(signals.ttft_p95_s - signals.queue_wait_p95_s, 0.0)


def assess_prefill(
    s: PrefillSignals,
    slo: PoolSLO,
    predicted: float | None,
    history: ScalingHistory,
    now_s: float,
    config: AutoscalingConfig,
) -> Assessment:
    n = s.num_target
    limit = slo.ttft_p95_s * config.slo_headroom
    p95_is_fresh = history.seconds_since_upscale(now_s) >= config.window_s
    p95_breach = p95_is_fresh and s.ttft_p95_s is not None and s.ttft_p95_s > slo.ttft_p95_s
    # With no queue the prediction is just the (P95-derived, possibly stale) service time.
    predicted_breach = s.num_pending_tokens > 0 and predicted is not None and predicted > limit
    wanted: int | None = None
    reason = ""
    if predicted_breach or p95_breach:
        wanted = max(n + 1, _prefill_replicas_needed(s, limit, config))
        reason = (
            f"predicted TTFT {predicted:.2f}s > {config.slo_headroom:g} x SLO "
            f"{slo.ttft_p95_s:g}s ({s.num_pending_tokens} pending tokens at "
            f"{s.prefill_tokens_per_s:.0f} tok/s/replica)"
            if predicted_breach and predicted is not None
            else f"TTFT P95 {s.ttft_p95_s:.2f}s > SLO {slo.ttft_p95_s:g}s"
        )
    calm_limit = slo.ttft_p95_s * config.downscale_margin
    busy_after = s.busy_fraction * s.num_replicas / (n - 1) if n > 1 else math.inf
    is_calm = (
        s.num_starting == 0
        and (s.ttft_p95_s is None or s.ttft_p95_s < calm_limit)
        and (predicted is None or predicted < calm_limit)
        and busy_after < config.downscale_utilization
    )
    calm_reason = (
        f"TTFT P95 {_fmt(s.ttft_p95_s)} < {config.downscale_margin:g} x SLO and "
        f"{n - 1} replicas would be {busy_after:.0%} busy"
    )
    return Assessment(wanted, reason, is_calm, calm_reason)


def _prefill_replicas_needed(s: PrefillSignals, limit_s: float, config: AutoscalingConfig) -> int:
    """Replicas that absorb the current load and drain the backlog within the latency budget."""
    if s.prefill_tokens_per_s <= 0:
        return s.num_target + 1
    budget_s = max(limit_s - (_service_s(s) or 0.0), config.backlog_drain_s)
    processed_per_s = s.prefill_tokens_per_s * s.busy_fraction * s.num_replicas
    demand_per_s = s.num_pending_tokens / budget_s + max(processed_per_s, s.arrived_tokens_per_s)
    return _ceil(demand_per_s / (s.prefill_tokens_per_s * config.target_utilization))


def assess_decode(
    s: DecodeSignals,
    slo: PoolSLO,
    history: ScalingHistory,
    now_s: float,
    config: AutoscalingConfig,
) -> Assessment:
    n, ready = s.num_target, s.num_replicas
    has_waiting = s.num_waiting > 0
    waiting_since = held_since(history.waiting_since_s, has_waiting, now_s)
    p95_is_fresh = history.seconds_since_upscale(now_s) >= config.window_s
    needs: list[tuple[int, str]] = []
    if p95_is_fresh and s.tpot_p95_s is not None and s.tpot_p95_s > slo.tpot_p95_s:
        # TPOT P95 describes requests that began up to a window plus a whole generation ago,
        # so it only adds one; KV usage and waiting sequences, which are current, size a step.
        needs.append(
            (
                n + 1,
                f"TPOT P95 {s.tpot_p95_s * 1e3:.0f}ms > SLO {slo.tpot_p95_s * 1e3:.0f}ms",
            )
        )
    if s.kv_cache_usage > config.kv_usage_high:
        needs.append(
            (
                math.ceil(ready * s.kv_cache_usage / config.kv_usage_target),
                f"KV-cache usage {s.kv_cache_usage:.0%} > {config.kv_usage_high:.0%}",
            )
        )
    if waiting_since is not None and now_s - waiting_since >= config.waiting_sustain_s:
        needs.append(
            (
                math.ceil(ready * (s.num_running + s.num_waiting) / max(s.num_running, 1)),
                f"{s.num_waiting} sequences waiting for {now_s - waiting_since:.0f}s",
            )
        )
    wanted = max(n + 1, *(need for need, _ in needs)) if needs else None
    reason = "; ".join(why for _, why in needs)
    if wanted is not None and s.num_starting > 0:
        # KV usage and waiting count only serving replicas; the starting ones were sized for
        # this demand already, and repeating the scale-up before they serve would overshoot.
        wanted = None
        reason += f"; {s.num_starting} replicas still starting"
    kv_after = s.kv_cache_usage * ready / (n - 1) if n > 1 else math.inf
    # Waiting counts once it has lasted `waiting_sustain_s`, for calm as for a breach: a
    # sequence waits for its KV to arrive on every handoff (vLLM counts it waiting too), so
    # "none waiting right now" flips tick by tick on a pool that is idle in all else.
    waited = waiting_since is not None and now_s - waiting_since >= config.waiting_sustain_s
    is_calm = (
        s.num_starting == 0
        and not waited
        and (s.tpot_p95_s is None or s.tpot_p95_s < slo.tpot_p95_s * config.downscale_margin)
        and kv_after < config.kv_usage_low
    )
    calm_reason = (
        f"TPOT P95 {_fmt(s.tpot_p95_s)} < {config.downscale_margin:g} x SLO and "
        f"{n - 1} replicas would use {kv_after:.0%} of KV cache"
    )
    return Assessment(wanted, reason, is_calm, calm_reason, has_waiting)


def _decide(
    inputs: PrefillSignals | DecodeSignals,
    assessment: Assessment,
    bounds: ReplicaBounds,
    pin: int | None,
    history: ScalingHistory,
    now_s: float,
    config: AutoscalingConfig,
    predicted: float | None,
) -> Decision:
    current = inputs.num_target
    wanted = assessment.wanted_replicas
    history = history.with_timers(
        now_s,
        breach=wanted is not None and pin is None,
        calm=assessment.is_calm and pin is None,
        waiting=assessment.has_waiting,
    )
    target, reason = current, ""
    if pin is not None:
        target = bounds.clamp(pin)
        reason = f"pinned to {pin}" + (
            f", clamped to bounds [{bounds.min_replicas}, {bounds.max_replicas}]"
            if target != pin
            else ""
        )
    elif bounds.clamp(current) != current:
        target = bounds.clamp(current)
        reason = f"brought into bounds [{bounds.min_replicas}, {bounds.max_replicas}]"
    elif wanted is not None:
        cooldown_left = config.upscale_cooldown_s - history.seconds_since_upscale(now_s)
        cap = max(current + 1, math.ceil(current * config.max_upscale_factor))
        if cooldown_left > 0:
            reason = f"hold: {assessment.breach_reason}, upscale cool-down {cooldown_left:.0f}s"
        elif current >= bounds.max_replicas:
            reason = f"hold at max_replicas {bounds.max_replicas}: {assessment.breach_reason}"
        else:
            target = bounds.clamp(min(wanted, cap))
            capped = " (capped by max step)" if wanted > cap else ""
            reason = f"up: {assessment.breach_reason}; want {wanted}{capped}"
    elif assessment.is_calm and current > bounds.min_replicas:
        calm_for = now_s - (history.calm_since_s if history.calm_since_s is not None else now_s)
        cooldown_left = config.downscale_cooldown_s - history.seconds_since_event(now_s)
        if calm_for < config.downscale_delay_s:
            reason = f"hold: calm for {calm_for:.0f}s of {config.downscale_delay_s:g}s"
        elif cooldown_left > 0:
            reason = f"hold: calm, downscale cool-down {cooldown_left:.0f}s"
        else:
            target = current - 1
            reason = f"down: {assessment.calm_reason} for {calm_for:.0f}s"
    else:
        reason = f"hold: {assessment.breach_reason or 'within SLO'}"
    if target != current:
        event = ScaleEvent(now_s, current, target, reason)
        history = history.with_event(event, config.history_length)
    return Decision(target, current, reason, inputs, predicted, history)


def _ceil(replicas: float) -> int:
    """ceil, saturating: a speed near zero must not overflow (the max step caps it anyway)."""
    return math.ceil(replicas) if replicas < _HUGE else _HUGE


_HUGE = 10**9


def _fmt(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{value_s:.3g}s"
