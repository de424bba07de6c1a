"""The pure autoscaling decisions on hand-made signals: milliseconds, no Ray."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaling.config import AutoscalingConfig
from autoscaling.history import ScalingHistory
from autoscaling.policy import Decision, decide_decode, decide_prefill
from autoscaling.signals import (
    DecodeReplicaReport,
    DecodeSignals,
    PrefillReplicaReport,
    PrefillSignals,
    RouterQueueReport,
    aggregate_decode,
    aggregate_prefill,
    window_percentile,
)
from control.records import PoolSLO, ReplicaBounds
from engine.autoscaling_stats import TimedSample, percentile

SLO = PoolSLO(ttft_p95_s=5.0, tpot_p95_s=0.2)
BOUNDS = ReplicaBounds(1, 16)
CONFIG = AutoscalingConfig()


def make_prefill(**overrides: object) -> PrefillSignals:
    fields: dict[str, object] = {
        "ttft_p95_s": 1.5,
        "queue_wait_p95_s": 0.2,
        "num_pending_tokens": 0,
        "num_ongoing_requests": 1,
        "prefill_tokens_per_s": 500.0,
        "busy_fraction": 0.6,
        "num_replicas": 2,
        "arrived_tokens_per_s": 600.0,
    }
    fields.update(overrides)
    return PrefillSignals(**fields)  # type: ignore[arg-type]


def make_decode(**overrides: object) -> DecodeSignals:
    fields: dict[str, object] = {
        "tpot_p95_s": 0.1,
        "num_running": 10,
        "num_waiting": 0,
        "kv_cache_usage": 0.6,
        "num_replicas": 2,
    }
    fields.update(overrides)
    return DecodeSignals(**fields)  # type: ignore[arg-type]


def prefill_at(signals: PrefillSignals, history: ScalingHistory, now: float) -> Decision:
    return decide_prefill(signals, SLO, BOUNDS, None, history, now, CONFIG)


# Percentiles and aggregation.
def test_percentile_interpolates_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 95) == 3.0
    assert percentile([], 95) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_window_percentile_keeps_only_the_window() -> None:
    samples = [TimedSample(t, v) for t, v in [(0.0, 100.0), (45.0, 1.0), (50.0, 2.0), (60, 3.0)]]
    assert window_percentile(samples, now_s=60.0, window_s=20.0, q=100) == 3.0
    assert window_percentile(samples, now_s=60.0, window_s=20.0, q=0) == 1.0
    assert window_percentile(samples, now_s=60.0, window_s=60.0, q=100) == 3.0  # 0.0 is out
    assert window_percentile(samples, now_s=200.0, window_s=10.0, q=95) is None


def test_aggregate_pools_samples_not_p95s() -> None:
    fast = PrefillReplicaReport(tuple([1.0] * 19), tuple([0.0] * 19), 100, 1, 400.0, 0.5)
    slow = PrefillReplicaReport((20.0,), (19.0,), 300, 2, 600.0, 0.5)
    router = RouterQueueReport(num_queued_requests=3, num_queued_tokens=1000)
    pool = aggregate_prefill([fast, slow], q=100, num_starting=1, router=router)
    assert pool.ttft_p95_s == 20.0 and pool.queue_wait_p95_s == 19.0
    assert pool.num_pending_tokens == 1400 and pool.num_ongoing_requests == 6
    assert pool.prefill_tokens_per_s == pytest.approx(500.0)
    assert (pool.num_replicas, pool.num_starting, pool.num_target) == (2, 1, 3)
    decode = aggregate_decode(
        [DecodeReplicaReport((0.1, 0.3), 4, 1, 0.2), DecodeReplicaReport((0.2,), 6, 0, 0.6)],
        q=50,
        num_router_waiting=2,
    )
    assert decode.tpot_p95_s == pytest.approx(0.2)
    assert (decode.num_running, decode.num_waiting) == (10, 3)
    assert decode.kv_cache_usage == pytest.approx(0.4)


# Prefill.
def test_queue_predictor_scales_before_ttft_breaches() -> None:
    # TTFT P95 is still fine, but 12k tokens wait for 2 replicas at 500 tok/s: ~12 s to drain.
    signals = make_prefill(ttft_p95_s=2.0, num_pending_tokens=12_000, arrived_tokens_per_s=1500)
    decision = prefill_at(signals, ScalingHistory(), 100.0)
    assert decision.predicted_ttft_s == pytest.approx(12.0 + 1.8)
    assert decision.target_replicas > 2
    assert decision.reason.startswith("up: predicted TTFT")
    assert decision.history.last_upscale_at_s == 100.0


def test_upscale_is_proportional_and_capped() -> None:
    signals = make_prefill(num_pending_tokens=10**7, arrived_tokens_per_s=10**5)
    decision = prefill_at(signals, ScalingHistory(), 0.0)
    assert decision.target_replicas == 2 * int(CONFIG.max_upscale_factor)
    assert "capped by max step" in decision.reason
    modest = prefill_at(make_prefill(num_pending_tokens=6000), ScalingHistory(), 0.0)
    assert modest.target_replicas == 3


def test_upscale_cooldown_then_fires_again() -> None:
    signals = make_prefill(num_pending_tokens=20_000)
    first = prefill_at(signals, ScalingHistory(), 0.0)
    grown = signals._replace(num_replicas=first.target_replicas, num_pending_tokens=10**6)
    held = prefill_at(grown, first.history, CONFIG.tick_s)
    assert held.target_replicas == first.target_replicas and "cool-down" in held.reason
    later = prefill_at(grown, held.history, CONFIG.upscale_cooldown_s)
    assert later.target_replicas > first.target_replicas


def test_stale_ttft_breach_does_not_rescale_right_after_upscale() -> None:
    first = prefill_at(make_prefill(num_pending_tokens=20_000), ScalingHistory(), 0.0)
    # The queue is gone; the window still holds the slow requests from before the scale-up.
    stale = make_prefill(ttft_p95_s=9.0, num_replicas=first.target_replicas)
    assert not prefill_at(stale, first.history, 30.0).is_scale_event
    assert prefill_at(stale, first.history, CONFIG.window_s + 10).target_replicas > 3


def run_calm(signals: PrefillSignals, ticks: int) -> list[Decision]:
    history, decisions = ScalingHistory(), []
    for tick in range(ticks):
        decision = prefill_at(signals, history, tick * CONFIG.tick_s)
        decisions.append(decision)
        history = decision.history
        signals = signals._replace(num_replicas=decision.target_replicas)
    return decisions


def test_downscale_waits_for_the_delay_then_steps_by_one() -> None:
    calm = make_prefill(num_replicas=6, busy_fraction=0.05, ttft_p95_s=1.0)
    decisions = run_calm(calm, ticks=60)
    events = [d for d in decisions if d.is_scale_event]
    assert events and all(d.target_replicas == d.current_replicas - 1 for d in events)
    times = [d.history.events[-1].at_s for d in events]
    assert times[0] >= CONFIG.downscale_delay_s
    assert all(b - a >= CONFIG.downscale_cooldown_s for a, b in itertools.pairwise(times))
    assert decisions[-1].target_replicas == BOUNDS.min_replicas


def test_busy_pool_does_not_scale_down() -> None:
    busy = make_prefill(num_replicas=3, busy_fraction=0.45, ttft_p95_s=1.0)
    assert not any(d.is_scale_event for d in run_calm(busy, ticks=60))


# Decode.
def test_a_decode_pool_is_calm_through_momentary_waiting_not_sustained_waiting() -> None:
    """A handoff's sequence waits while its KV arrives: one tick with waiting sequences keeps
    a pool calm; waiting that lasts `waiting_sustain_s` ends it."""
    idle = make_decode(tpot_p95_s=0.01, num_running=0, kv_cache_usage=0.1)
    one_waiting = idle._replace(num_waiting=1)
    calm = decide_decode(idle, SLO, BOUNDS, None, ScalingHistory(), 0.0, CONFIG)
    assert calm.reason.startswith("hold: calm"), calm.reason
    still = decide_decode(one_waiting, SLO, BOUNDS, None, calm.history, 10.0, CONFIG)
    assert still.reason.startswith("hold: calm"), still.reason
    assert still.history.calm_since_s == 0.0
    late = CONFIG.waiting_sustain_s + 10.0
    ended = decide_decode(one_waiting, SLO, BOUNDS, None, still.history, late, CONFIG)
    assert not ended.reason.startswith("hold: calm"), ended.reason


def test_decode_scales_on_kv_usage_and_sustained_waiting() -> None:
    full = decide_decode(make_decode(kv_cache_usage=0.95), SLO, BOUNDS, None, ScalingHistory(), 0)
    assert full.target_replicas == 3 and "KV-cache usage" in full.reason
    history = ScalingHistory()
    waiting = make_decode(num_waiting=10, num_running=10)
    early = decide_decode(waiting, SLO, BOUNDS, None, history, 0.0)
    assert not early.is_scale_event
    late = decide_decode(waiting, SLO, BOUNDS, None, early.history, CONFIG.waiting_sustain_s)
    assert late.target_replicas == 4 and "waiting" in late.reason


def test_decode_tpot_breach_adds_one_and_waits_for_starting_replicas() -> None:
    slow = make_decode(tpot_p95_s=0.3)
    assert decide_decode(slow, SLO, BOUNDS, None, ScalingHistory(), 0).target_replicas == 3
    starting = make_decode(kv_cache_usage=0.95, num_starting=2)
    held = decide_decode(starting, SLO, BOUNDS, None, ScalingHistory(), 0)
    assert not held.is_scale_event and "starting" in held.reason


# Pins and bounds.
def test_pin_overrides_and_is_clamped() -> None:
    breach = make_prefill(num_pending_tokens=10**6)
    pinned = decide_prefill(breach, SLO, BOUNDS, 2, ScalingHistory(), 0.0)
    assert pinned.target_replicas == 2 and pinned.reason == "pinned to 2"
    high = decide_prefill(breach, SLO, BOUNDS, 100, ScalingHistory(), 0.0)
    assert high.target_replicas == 16 and "clamped to bounds [1, 16]" in high.reason
    low = decide_decode(make_decode(), SLO, ReplicaBounds(3, 8), 0, ScalingHistory(), 0.0)
    assert low.target_replicas == 3 and "clamped" in low.reason


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_replicas"):
        ReplicaBounds(4, 2)
    with pytest.raises(ValueError, match="ttft_p95_s"):
        PoolSLO(ttft_p95_s=0)
    with pytest.raises(ValueError, match="downscale_margin"):
        AutoscalingConfig(downscale_margin=1.5)


optional_latency = st.none() | st.floats(0.0, 100.0)
bounds_strategy = st.tuples(st.integers(0, 20), st.integers(1, 40)).filter(
    lambda b: b[1] >= max(b[0], 1)
)


@settings(max_examples=100, deadline=None)
@given(
    ttft=optional_latency,
    wait=optional_latency,
    pending=st.integers(0, 10**7),
    speed=st.floats(0.0, 1e5),
    busy=st.floats(0.0, 1.0),
    ready=st.integers(0, 50),
    starting=st.integers(0, 10),
    bounds=bounds_strategy,
    pin=st.none() | st.integers(-5, 100),
    now=st.floats(0.0, 1e5),
    last_up=st.none() | st.floats(0.0, 1e5),
)
def test_prefill_always_obeys_pin_and_bounds(
    ttft: float | None,
    wait: float | None,
    pending: int,
    speed: float,
    busy: float,
    ready: int,
    starting: int,
    bounds: tuple[int, int],
    pin: int | None,
    now: float,
    last_up: float | None,
) -> None:
    signals = make_prefill(
        ttft_p95_s=ttft,
        queue_wait_p95_s=wait,
        num_pending_tokens=pending,
        prefill_tokens_per_s=speed,
        busy_fraction=busy,
        num_replicas=ready,
        num_starting=starting,
    )
    replica_bounds = ReplicaBounds(*bounds)
    history = ScalingHistory(last_upscale_at_s=last_up)
    decision = decide_prefill(signals, SLO, replica_bounds, pin, history, now, CONFIG)
    _check(decision, replica_bounds, pin, ready + starting)


@settings(max_examples=100, deadline=None)
@given(
    tpot=optional_latency,
    running=st.integers(0, 500),
    waiting=st.integers(0, 500),
    kv=st.floats(0.0, 1.0),
    ready=st.integers(0, 50),
    starting=st.integers(0, 10),
    bounds=bounds_strategy,
    pin=st.none() | st.integers(-5, 100),
    now=st.floats(0.0, 1e5),
    waiting_since=st.none() | st.floats(0.0, 1e5),
)
def test_decode_always_obeys_pin_and_bounds(
    tpot: float | None,
    running: int,
    waiting: int,
    kv: float,
    ready: int,
    starting: int,
    bounds: tuple[int, int],
    pin: int | None,
    now: float,
    waiting_since: float | None,
) -> None:
    signals = make_decode(
        tpot_p95_s=tpot,
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        num_replicas=ready,
        num_starting=starting,
    )
    replica_bounds = ReplicaBounds(*bounds)
    since = None if waiting_since is None else min(waiting_since, now)
    history = ScalingHistory(waiting_since_s=since, calm_since_s=0.0)
    decision = decide_decode(signals, SLO, replica_bounds, pin, history, now, CONFIG)
    _check(decision, replica_bounds, pin, ready + starting)


def _check(decision: Decision, bounds: ReplicaBounds, pin: int | None, current: int) -> None:
    target = decision.target_replicas
    assert decision.current_replicas == current
    if pin is not None:
        assert target == bounds.clamp(pin)
    elif bounds.min_replicas <= current <= bounds.max_replicas:
        assert bounds.min_replicas <= target <= bounds.max_replicas
        assert target >= current - 1  # down one at a time
    else:
        assert target == bounds.clamp(current)
    assert decision.is_scale_event == bool(decision.history.events)
