"""Replica windows, the metric-dict contract, policy-state codecs, durations: no Ray or Redis."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from autoscaling.control_reader import ControlReader, ControlSettings
from autoscaling.history import ScaleEvent, ScalingHistory
from autoscaling.policy import decide_prefill
from autoscaling.serve_metrics import (
    decision_inputs,
    decode_report_from_metrics,
    history_from_state,
    history_to_state,
    latest_replica_metrics,
    prefill_report_from_metrics,
    reason_kind,
)
from autoscaling.signals import DecodeReplicaReport, PrefillReplicaReport, PrefillSignals
from control.records import PoolSLO, ReplicaBounds
from deploy.cli_ops import parse_duration
from engine.autoscaling_stats import (
    DECODE_METRIC_KEYS,
    PREFILL_METRIC_KEYS,
    DecodeWindow,
    PrefillWindow,
)
from tests.clock import FakeClock


def make_prefill_window(clock: FakeClock, window_s: float = 60.0, q: float = 95.0) -> PrefillWindow:
    return PrefillWindow(window_s, q, clock=clock)


def finish(window: PrefillWindow, clock: FakeClock, tokens: int, ttft_s: float) -> None:
    """A prefill of `tokens` that took `ttft_s`, all of it compute."""
    token = window.request_started(tokens)
    clock.advance(ttft_s)
    window.request_finished(token, queue_wait_s=0.0, compute_s=ttft_s)


# --- PrefillWindow -------------------------------------------------------------------------


def test_empty_prefill_window_reports_no_sample() -> None:
    report = make_prefill_window(FakeClock()).report()
    assert set(report) == {*PREFILL_METRIC_KEYS, "prefill_step_p95_s"}
    assert report["ttft_p95_s"] == report["queue_wait_p95_s"] == -1.0
    assert report["prefill_step_p95_s"] == -1.0
    assert report["num_pending_tokens"] == report["prefill_tokens_per_s"] == 0.0
    assert all(isinstance(value, float) for value in report.values())


def test_prefill_percentile_is_the_configured_one_under_the_p95_name() -> None:
    clock = FakeClock()
    p95, p50 = make_prefill_window(clock), make_prefill_window(clock, q=50.0)
    for i in range(1, 101):
        for window in (p95, p50):
            token = window.request_started(10)
            window.request_finished(
                token, queue_wait_s=i / 1000, compute_s=i / 100, ttft_s=float(i)
            )
            clock.advance(0.001)
    assert p95.report()["ttft_p95_s"] == pytest.approx(95.05)  # numpy's linear interpolation
    # The prompts' compute seconds (the split's signal, autoscaling/roles.py) likewise.
    assert p95.report()["prefill_step_p95_s"] == pytest.approx(0.9505)
    assert p50.report()["prefill_step_p95_s"] == pytest.approx(0.505)
    assert p95.report()["queue_wait_p95_s"] == pytest.approx(0.09505)
    assert p50.report()["ttft_p95_s"] == pytest.approx(50.5)


def test_a_prompts_step_is_its_compute_over_its_chunks() -> None:
    """With a chunked-prefill budget of 100 tokens, a 250-token prompt computed in 0.3 s took
    3 steps of 0.1 s each: what one step of it costs the streams beside it."""
    clock = FakeClock()
    for chunk_tokens, step_s in ((None, 0.3), (100, 0.1), (1000, 0.3)):
        window = PrefillWindow(60.0, 95.0, clock=clock, chunk_tokens=chunk_tokens)
        window.request_finished(window.request_started(250), queue_wait_s=0.0, compute_s=0.3)
        assert window.report()["prefill_step_p95_s"] == pytest.approx(step_s), chunk_tokens
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefillWindow(60.0, 95.0, chunk_tokens=0)


def test_pending_tokens_and_ongoing_requests_follow_start_finish_abort() -> None:
    clock = FakeClock()
    window = make_prefill_window(clock)
    first, second = window.request_started(300), window.request_started(200)
    report = window.report()
    assert (report["num_pending_tokens"], report["num_ongoing_requests"]) == (500.0, 2.0)
    window.request_aborted(first)
    clock.advance(1.5)
    window.request_finished(second, queue_wait_s=0.5, compute_s=1.0)
    report = window.report()
    assert (report["num_pending_tokens"], report["num_ongoing_requests"]) == (0.0, 0.0)
    # The aborted request left no sample; the finished one's TTFT defaults to 1.5 s elapsed.
    assert report["ttft_p95_s"] == pytest.approx(1.5)
    assert report["queue_wait_p95_s"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown or already ended"):
        window.request_finished(second, queue_wait_s=0.0, compute_s=0.0)


def test_samples_expire_after_the_window() -> None:
    clock = FakeClock()
    window = make_prefill_window(clock, window_s=10.0)
    finish(window, clock, 100, ttft_s=2.0)
    clock.advance(9.9)
    assert window.report()["ttft_p95_s"] == pytest.approx(2.0)
    clock.advance(0.2)  # the sample is now 10.1 s old
    report = window.report()
    assert report["ttft_p95_s"] == -1.0
    assert report["busy_fraction"] == report["prefill_tokens_per_s"] == 0.0


def test_batched_prefills_count_busy_time_once() -> None:
    clock = FakeClock()
    window = make_prefill_window(clock, window_s=10.0)
    clock.advance(10.0)  # older than the window: busy share is over the whole window
    # Two prompts computed in the same 1-second batch, then one alone for 1 second.
    a, b = window.request_started(400), window.request_started(600)
    clock.advance(1.0)
    window.request_finished(a, queue_wait_s=0.0, compute_s=1.0)
    window.request_finished(b, queue_wait_s=0.0, compute_s=1.0)
    finish(window, clock, 1000, ttft_s=1.0)
    report = window.report()
    assert report["busy_fraction"] == pytest.approx(2.0 / 10.0)
    assert report["prefill_tokens_per_s"] == pytest.approx(2000 / 2.0)


def test_a_young_replica_is_judged_on_its_lifetime() -> None:
    clock = FakeClock()
    window = make_prefill_window(clock, window_s=60.0)
    finish(window, clock, 100, ttft_s=2.0)
    clock.advance(2.0)
    assert window.report()["busy_fraction"] == pytest.approx(0.5)


def test_prefill_window_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PrefillWindow(0.0, 95.0)
    with pytest.raises(ValueError, match="percentile"):
        PrefillWindow(60.0, 0.0)
    window = make_prefill_window(FakeClock())
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        window.request_started(-1)
    token = window.request_started(1)
    with pytest.raises(ValueError, match="compute_s"):
        window.request_finished(token, queue_wait_s=0.0, compute_s=-1.0)


# --- DecodeWindow --------------------------------------------------------------------------


def test_decode_window_reports_tpot_percentile_and_engine_state() -> None:
    clock = FakeClock()
    window = DecodeWindow(30.0, 95.0, clock=clock)
    assert window.report(0, 0, 0.0)["tpot_p95_s"] == -1.0
    for i in range(1, 101):
        window.record_tpot(i / 1000)
    report = window.report(num_running=12, num_waiting=3, kv_cache_usage=0.75)
    assert set(report) == {*DECODE_METRIC_KEYS, "tpot_p50_s"}
    assert report["tpot_p95_s"] == pytest.approx(0.09505)
    assert report["tpot_p50_s"] == pytest.approx(0.0505)  # the gap the streams take anyway
    assert (report["num_running"], report["num_waiting"], report["kv_cache_usage"]) == (
        12.0,
        3.0,
        0.75,
    )
    clock.advance(30.0)
    assert window.report(0, 0, 0.0)["tpot_p95_s"] == -1.0
    with pytest.raises(ValueError, match="tpot_s"):
        window.record_tpot(float("nan"))


# --- metric dict -> replica report ----------------------------------------------------------


def test_prefill_report_from_window_metrics() -> None:
    clock = FakeClock()
    window = make_prefill_window(clock)
    clock.advance(60.0)
    finish(window, clock, 600, ttft_s=1.5)
    window.request_started(250)
    report = prefill_report_from_metrics(window.report())
    assert report.busy_fraction == pytest.approx(1.5 / 60.0)
    assert report._replace(busy_fraction=0.0) == PrefillReplicaReport(
        ttft_s=(1.5,),
        queue_wait_s=(0.0,),
        num_pending_tokens=250,
        num_ongoing_requests=1,
        prefill_tokens_per_s=400.0,
        busy_fraction=0.0,
    )


def test_no_sample_maps_to_an_empty_tuple_and_counts_round() -> None:
    metrics = dict.fromkeys(PREFILL_METRIC_KEYS, 0.0)
    metrics.update(ttft_p95_s=-1.0, queue_wait_p95_s=-0.25, num_pending_tokens=299.9999)
    report = prefill_report_from_metrics(metrics)
    assert (report.ttft_s, report.queue_wait_s, report.num_pending_tokens) == ((), (), 300)
    assert decode_report_from_metrics(
        {"tpot_p95_s": -1.0, "num_running": 4.0, "num_waiting": 1.0, "kv_cache_usage": 1.2}
    ) == DecodeReplicaReport(tpot_s=(), num_running=4, num_waiting=1, kv_cache_usage=1.0)


def test_a_missing_or_non_finite_metric_is_a_value_error() -> None:
    metrics = dict.fromkeys(DECODE_METRIC_KEYS, 0.0)
    del metrics["kv_cache_usage"]
    with pytest.raises(ValueError, match="kv_cache_usage"):
        decode_report_from_metrics(metrics)
    with pytest.raises(ValueError, match="busy_fraction"):
        prefill_report_from_metrics(
            {**dict.fromkeys(PREFILL_METRIC_KEYS, 0.0), "busy_fraction": float("inf")}
        )


def test_latest_raw_point_wins_over_the_look_back_mean() -> None:
    point = SimpleNamespace
    aggregated = {"ttft_p95_s": {"r1": 0.5, "r2": 3.0}, "busy_fraction": {"r1": 0.4}}
    raw = {
        "ttft_p95_s": {"r1": [point(timestamp=2.0, value=2.0), point(timestamp=1.0, value=-1.0)]}
    }
    assert latest_replica_metrics(aggregated, raw) == {
        "r1": {"ttft_p95_s": 2.0, "busy_fraction": 0.4},
        "r2": {"ttft_p95_s": 3.0},
    }
    assert latest_replica_metrics(None, None) == {}


# --- policy state and decision log ----------------------------------------------------------


def test_history_state_round_trips_through_json() -> None:
    history = ScalingHistory(
        last_upscale_at_s=100.0,
        breach_since_s=90.5,
        calm_since_s=None,
        waiting_since_s=12.0,
        events=(ScaleEvent(100.0, 2, 5, "up: TTFT P95 8.00s > SLO 5s; want 5"),),
    )
    state = json.loads(json.dumps(history_to_state(history)))
    assert history_from_state(state) == history
    assert history_from_state(None) == history_from_state({}) == ScalingHistory()


@pytest.mark.parametrize(
    "state",
    [
        {"last_upscale_at_s": "soon"},
        {"events": "none"},
        {"events": [[1.0, 2, 3]]},
        {"events": [[1.0, "2", 3, "why"]]},
    ],
)
def test_malformed_history_state_is_a_value_error(state: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="history state"):
        history_from_state(state)


def test_decision_inputs_are_finite_floats_with_slo_and_pin() -> None:
    signals = PrefillSignals(
        ttft_p95_s=None,
        queue_wait_p95_s=None,
        num_pending_tokens=100,
        num_ongoing_requests=1,
        prefill_tokens_per_s=0.0,
        busy_fraction=0.0,
        num_replicas=0,
    )
    decision = decide_prefill(signals, PoolSLO(), ReplicaBounds(0, 4), 2, ScalingHistory(), 1.0)
    inputs = decision_inputs(decision, PoolSLO(ttft_p95_s=0.5), pin=2)
    assert "ttft_p95_s" not in inputs and "predicted_ttft_s" not in inputs  # None and inf
    assert inputs["num_pending_tokens"] == 100.0
    assert (inputs["slo_ttft_p95_s"], inputs["slo_tpot_p95_s"], inputs["pin"]) == (0.5, 0.2, 2.0)


def test_reason_kind_masks_numbers_only() -> None:
    assert reason_kind("hold: calm for 12s of 120s") == reason_kind("hold: calm for 13s of 120s")
    assert reason_kind("hold: calm for 12s of 120s") != reason_kind("hold: within SLO")
    assert reason_kind("up: TTFT P95 8.25s > SLO 5s") == "up: TTFT P# #s > SLO #s"


# --- durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("0.5s", 0.5), ("2s", 2.0), ("1m", 60.0), (" 60 ms ", 0.06), (".25s", 0.25)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["500", "", "ms", "-1s", "1h", "1e3ms", "nan s", "1,5s"])
def test_parse_duration_rejects_unclear_input(text: str) -> None:
    with pytest.raises(ValueError, match="unit ms, s or m"):
        parse_duration(text)


def test_control_reader_without_a_url_falls_back_to_its_defaults() -> None:
    defaults = ControlSettings(PoolSLO(1.0, 0.1), ReplicaBounds(2, 4))
    env = "PDSERVE_TEST_UNSET_REDIS_URL"
    reader = ControlReader(None, "app", "decode", defaults, 1.0, 0.2, redis_url_env=env)
    assert reader.read(0.0) == replace(
        defaults,
        error=f"{env} is not set in the Serve controller's environment; default SLO, bounds, pin",
    )
    assert ControlReader(None, "app", "decode", defaults, 1.0, 0.2).read(0.0) == defaults
    with pytest.raises(ValueError, match="not both"):
        ControlReader("redis://x", "app", "decode", defaults, 1.0, 0.2, redis_url_env=env)
