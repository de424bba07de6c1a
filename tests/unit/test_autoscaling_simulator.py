"""The P/D simulator on seeded traces, and our policy against the queue-length baseline."""

from __future__ import annotations

import itertools
import math

import pytest

from autoscaling.config import DEFAULT_CONFIG
from autoscaling.sim.baseline import queue_length_policies
from autoscaling.sim.pool_policies import slo_policies
from autoscaling.sim.profiles import CPU_FP32_1CORE
from autoscaling.sim.results import SimResult
from autoscaling.sim.simulator import SimSettings, simulate
from autoscaling.sim.trace import ArrivalTrace, LengthRange, RateSegment, bursty_trace
from control.records import PoolSLO, ReplicaBounds

SLO = PoolSLO(ttft_p95_s=5.0, tpot_p95_s=0.2)
SETTINGS = SimSettings(profile=CPU_FP32_1CORE, slo=SLO)
PROMPTS = LengthRange(128, 1024)
OUTPUTS = LengthRange(32, 256)


def make_trace(*segments: tuple[float, float], **overrides: object) -> ArrivalTrace:
    fields: dict[str, object] = {"prompt_tokens": PROMPTS, "output_tokens": OUTPUTS, "seed": 3}
    fields.update(overrides)
    return ArrivalTrace(tuple(RateSegment(*s) for s in segments), **fields)  # type: ignore[arg-type]


def run(trace: ArrivalTrace, **policy: object) -> SimResult:
    return simulate(trace, slo_policies(SLO, **policy), SETTINGS)  # type: ignore[arg-type]


def test_every_arrival_is_accounted_for_and_runs_repeat() -> None:
    trace = make_trace((300, 0.5), (300, 3.0), (300, 0.5), output_tokens=LengthRange(2, 300))
    first, second = run(trace), run(trace)
    assert first.num_arrived == len(trace.requests()) > 1000
    assert first.num_finished + first.num_rejected + first.num_unfinished == first.num_arrived
    assert first.num_unfinished == 0 and first.num_rejected == 0
    assert all(o.ttft_s > 0 and o.tpot_s > 0 for o in first.outcomes)
    assert first == second


def test_oversized_requests_are_rejected_and_counted() -> None:
    trace = make_trace((120, 0.5), prompt_tokens=LengthRange(5000, 6000))
    result = run(trace)
    assert result.num_rejected > 0
    assert result.num_finished + result.num_rejected == result.num_arrived


def test_step_up_scales_prefill_on_the_queue_before_ttft_breaches() -> None:
    step_s = 300.0
    result = run(make_trace((step_s, 0.3), (600, 3.0)))
    ups = [e.event for e in result.events_after(step_s, "prefill") if e.event.is_upscale]
    assert ups, "no prefill scale-up after the step"
    first = ups[0]
    assert first.at_s <= step_s + 3 * DEFAULT_CONFIG.tick_s
    assert first.reason.startswith("up: predicted TTFT")
    assert result.peak_prefill_replicas >= 5


def test_decode_heavy_load_scales_decode_not_prefill() -> None:
    trace = make_trace(
        (900, 1.0), prompt_tokens=LengthRange(16, 64), output_tokens=LengthRange(300, 600)
    )
    result = run(trace)
    assert any(e.event.is_upscale for e in result.events if e.pool == "decode")
    assert not any(e.event.is_upscale for e in result.events if e.pool == "prefill")
    assert result.peak_decode_replicas >= 3


def test_steady_load_settles_without_scale_events() -> None:
    result = run(make_trace((2400, 1.5)))
    assert result.events, "the pools should have sized themselves first"
    late = result.events_after(900.0)
    # No oscillation: nothing scales up again, and at most one slow final trim per pool.
    assert not any(e.event.is_upscale for e in late), late
    assert all(sum(e.pool == pool for e in late) <= 1 for pool in ("prefill", "decode")), late
    assert result.slo_attainment > 0.9


def test_drop_scales_down_after_the_delay_one_step_at_a_time() -> None:
    drop_s = 900.0
    result = run(make_trace((drop_s, 3.0), (1500, 0.2)))
    downs = [e for e in result.events_after(drop_s) if not e.event.is_upscale]
    assert len(downs) >= 3
    assert all(e.event.to_replicas == e.event.from_replicas - 1 for e in downs)
    for pool in ("prefill", "decode"):
        events = [e.event for e in result.events if e.pool == pool]
        for before, event in itertools.pairwise(events):
            if event.is_upscale:
                continue
            assert event.at_s - before.at_s >= DEFAULT_CONFIG.downscale_cooldown_s
            last_up = max(e.at_s for e in events if e.is_upscale and e.at_s < event.at_s)
            assert event.at_s - last_up >= DEFAULT_CONFIG.downscale_delay_s
    assert result.events[-1].event.to_replicas <= 2


def test_pins_and_bounds_hold_in_simulation() -> None:
    trace = make_trace((300, 0.3), (600, 4.0))
    result = run(
        trace, prefill_bounds=ReplicaBounds(1, 3), decode_bounds=ReplicaBounds(2, 8), decode_pin=20
    )
    assert result.peak_prefill_replicas <= 3
    decode_targets = {e.event.to_replicas for e in result.events if e.pool == "decode"}
    assert decode_targets == {8}
    assert all("clamped" in e.event.reason for e in result.events if e.pool == "decode")


def test_slo_policy_beats_queue_length_on_the_bursty_trace() -> None:
    trace = bursty_trace(0.4, 10.0, 600, 600, 2, PROMPTS, OUTPUTS, seed=1)
    ours = simulate(trace, slo_policies(SLO), SETTINGS)
    baseline = simulate(trace, queue_length_policies(), SETTINGS)
    assert ours.num_arrived == baseline.num_arrived
    assert ours.slo_attainment > baseline.slo_attainment + 0.03
    assert ours.goodput_per_s > baseline.goodput_per_s


def test_gpu_profile_and_large_pools_run_fast() -> None:
    from autoscaling.sim.profiles import GPU_LIKE

    trace = make_trace((300, 40.0), prompt_tokens=LengthRange(512, 4096))
    bounds = ReplicaBounds(1, 2000)
    result = simulate(
        trace,
        slo_policies(PoolSLO(1.0, 0.05), bounds, bounds),
        SimSettings(profile=GPU_LIKE, slo=PoolSLO(1.0, 0.05), initial_prefill_replicas=2),
    )
    assert result.num_arrived > 10_000 and result.num_unfinished == 0
    assert result.peak_prefill_replicas > 2
    assert not math.isnan(result.slo_attainment)


@pytest.mark.parametrize("rate", [0.0, 0.05])
def test_idle_and_near_idle_traces_finish(rate: float) -> None:
    result = run(make_trace((600, rate)))
    assert result.num_unfinished == 0
