"""The policies' side of the contract with the replicas: metric dicts -> typed reports.

Serve carries what a replica's `record_autoscaling_stats()` returns to the controller as a
`dict[str, float]`, so the windows in `engine/autoscaling_stats.py` flatten their reports into
the keys defined there and the policies map them back here:

    PrefillWindow.report() ─ dict[str, float] ─> Serve ─> prefill_report_from_metrics ─┐
                                                                                      ├─> aggregate
    DecodeWindow.report()  ─ dict[str, float] ─> Serve ─> decode_report_from_metrics  ─┘

A latency key holds the replica's percentile of its window at `AutoscalingConfig.percentile`
(95 unless configured; the `_p95_s` names stay fixed), or NO_SAMPLE (-1.0) when the window is
empty, because a metric cannot be None. The pool then takes the percentile of the replicas'
percentiles: an approximation of the pooled percentile (only floats cross Serve, not samples).

Also here, because the policy keeps them in Serve's JSON-able policy state: the
`ScalingHistory` codec, the decision's inputs as floats, and `reason_kind`. No ray import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from autoscaling.history import ScaleEvent, ScalingHistory
from autoscaling.policy import Decision
from autoscaling.signals import DecodeReplicaReport, PrefillReplicaReport
from control.records import PoolSLO
from engine.autoscaling_stats import (
    BUSY_FRACTION,
    KV_CACHE_USAGE,
    NUM_ONGOING_REQUESTS,
    NUM_PENDING_TOKENS,
    NUM_RUNNING,
    NUM_WAITING,
    PREFILL_TOKENS_PER_S,
    QUEUE_WAIT_P95_S,
    TPOT_P95_S,
    TTFT_P95_S,
)


def prefill_report_from_metrics(metrics: Mapping[str, float]) -> PrefillReplicaReport:
    """One prefill replica's report from its metric dict; ValueError names a missing or bad key."""
    return PrefillReplicaReport(
        ttft_s=_samples(metrics, TTFT_P95_S),
        queue_wait_s=_samples(metrics, QUEUE_WAIT_P95_S),
        num_pending_tokens=_count(metrics, NUM_PENDING_TOKENS),
        num_ongoing_requests=_count(metrics, NUM_ONGOING_REQUESTS),
        prefill_tokens_per_s=max(_number(metrics, PREFILL_TOKENS_PER_S), 0.0),
        busy_fraction=_fraction(metrics, BUSY_FRACTION),
    )


def decode_report_from_metrics(metrics: Mapping[str, float]) -> DecodeReplicaReport:
    """One decode replica's report from its metric dict; ValueError names a missing or bad key."""
    return DecodeReplicaReport(
        tpot_s=_samples(metrics, TPOT_P95_S),
        num_running=_count(metrics, NUM_RUNNING),
        num_waiting=_count(metrics, NUM_WAITING),
        kv_cache_usage=_fraction(metrics, KV_CACHE_USAGE),
    )


def _number(metrics: Mapping[str, float], key: str) -> float:
    if key not in metrics:
        raise ValueError(f"replica metrics lack {key!r} (has {sorted(metrics)})")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"replica metric {key!r} must be a finite number, got {value!r}")
    return float(value)


def _samples(metrics: Mapping[str, float], key: str) -> tuple[float, ...]:
    # Any negative value is "no sample": a mean over Serve's look-back window of NO_SAMPLE and
    # a real value is not a latency either way.
    value = _number(metrics, key)
    return () if value < 0 else (value,)


def _count(metrics: Mapping[str, float], key: str) -> int:
    # Round, not truncate: a count averaged by Serve's aggregation may arrive as 2.9999.
    return max(round(_number(metrics, key)), 0)


def _fraction(metrics: Mapping[str, float], key: str) -> float:
    return min(max(_number(metrics, key), 0.0), 1.0)


def latest_replica_metrics(
    aggregated: Mapping[Any, Mapping[Any, float]] | None,
    raw: Mapping[Any, Mapping[Any, Sequence[Any]]] | None,
) -> dict[Any, dict[str, float]]:
    """Each replica's latest value of each metric, from an `AutoscalingContext`'s
    `aggregated_metrics` ({metric: {replica: float}}) and `raw_metrics` ({metric: {replica:
    [TimeStampedValue]}}); only running replicas appear in either.

    The latest point wins: a report is already a window, and Serve's look-back mean would blend
    a -1.0 "no sample" into a real percentile. The aggregate only fills in where no raw series
    was passed.
    """
    latest: dict[Any, dict[str, float]] = {}
    for name, by_replica in (aggregated or {}).items():
        for replica, value in by_replica.items():
            latest.setdefault(replica, {})[str(name)] = float(value)
    for name, series_by_replica in (raw or {}).items():
        for replica, series in series_by_replica.items():
            if series:
                point = max(series, key=lambda p: p.timestamp)
                latest.setdefault(replica, {})[str(name)] = float(point.value)
    return latest


# --- Policy state: Serve keeps a JSON-able dict per deployment between calls. ------------------

_TIMER_FIELDS = (
    "last_upscale_at_s",
    "last_downscale_at_s",
    "breach_since_s",
    "calm_since_s",
    "waiting_since_s",
)


def history_to_state(history: ScalingHistory) -> dict[str, Any]:
    """A JSON-able form of `history` (floats, None and lists only)."""
    state: dict[str, Any] = {name: getattr(history, name) for name in _TIMER_FIELDS}
    state["events"] = [list(event) for event in history.events]
    return state


def history_from_state(state: Mapping[str, Any] | None) -> ScalingHistory:
    """The inverse of `history_to_state`; None or {} is a fresh history. ValueError when
    malformed, so a policy can start afresh instead of deciding on garbage."""
    if not state:
        return ScalingHistory()
    timers: dict[str, float | None] = {}
    for name in _TIMER_FIELDS:
        value = state.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"history state: {name!r} must be a number or null, got {value!r}")
        timers[name] = None if value is None else float(value)
    raw_events = state.get("events", [])
    if not isinstance(raw_events, list):
        raise ValueError(f"history state: 'events' must be a list, got {raw_events!r}")
    events = tuple(_event(raw) for raw in raw_events)
    return ScalingHistory(**timers, events=events)


def _event(raw: object) -> ScaleEvent:
    if not isinstance(raw, list | tuple) or len(raw) != 4:
        raise ValueError(f"history state: an event must be [at_s, from, to, reason], got {raw!r}")
    at_s, from_replicas, to_replicas, reason = raw
    if not (
        isinstance(at_s, int | float)
        and isinstance(from_replicas, int)
        and isinstance(to_replicas, int)
        and isinstance(reason, str)
    ):
        raise ValueError(f"history state: malformed event {raw!r}")
    return ScaleEvent(float(at_s), from_replicas, to_replicas, reason)


def decision_inputs(decision: Decision, slo: PoolSLO, pin: int | None) -> dict[str, float]:
    """What drove `decision`, as the finite floats a `DecisionRecord` holds."""
    inputs: dict[str, float] = {}
    for name, value in decision.inputs._asdict().items():
        if value is not None and math.isfinite(value):
            inputs[name] = float(value)
    if decision.predicted_ttft_s is not None and math.isfinite(decision.predicted_ttft_s):
        inputs["predicted_ttft_s"] = decision.predicted_ttft_s
    inputs["slo_ttft_p95_s"] = slo.ttft_p95_s
    inputs["slo_tpot_p95_s"] = slo.tpot_p95_s
    if pin is not None:
        inputs["pin"] = float(pin)
    return inputs


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def reason_kind(reason: str) -> str:
    """`reason` with its numbers masked: "hold: calm for 12s of 120s" and "... 13s ..." are one
    kind, so a log that records changes of kind is not flooded by a ticking counter."""
    return _NUMBER.sub("#", reason)
