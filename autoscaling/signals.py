"""What a replica reports each push interval, and the pool aggregate the policy decides on.

A replica keeps its raw latency samples; `window_percentile` turns them into the P95 it would
report alone. Pools are aggregated from the *samples* of every replica rather than from their
P95s, because the P95 of P95s is not a P95: one slow replica among twenty is the tail.

    replica samples ──> PrefillReplicaReport ──┐
    replica samples ──> PrefillReplicaReport ──┼─> aggregate_prefill ─> PrefillSignals
                                               ┘      (config.percentile)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from engine.autoscaling_stats import TimedSample, percentile


def in_window(samples: Iterable[TimedSample], now_s: float, window_s: float) -> list[float]:
    """Values of the samples taken in (now - window, now]."""
    start = now_s - window_s
    return [s.value_s for s in samples if start < s.at_s <= now_s]


def window_percentile(
    samples: Iterable[TimedSample], now_s: float, window_s: float, q: float
) -> float | None:
    """The q-th percentile of the samples in the last `window_s`; None if there are none."""
    return percentile(in_window(samples, now_s, window_s), q)


class PrefillReplicaReport(NamedTuple):
    """One prefill replica's window: raw samples plus instantaneous queue state."""

    ttft_s: tuple[float, ...]
    queue_wait_s: tuple[float, ...]
    num_pending_tokens: int
    num_ongoing_requests: int
    # Tokens prefilled per second of busy time: the replica's speed, not its load.
    prefill_tokens_per_s: float
    # Share of the window spent computing (0..1): its load.
    busy_fraction: float


class RouterQueueReport(NamedTuple):
    """Requests the router holds until a replica has room (Ray Serve queues at the handle)."""

    num_queued_requests: int = 0
    num_queued_tokens: int = 0
    # Prompt tokens that arrived per second over a recent window: the demand.
    arrived_tokens_per_s: float = 0.0


class DecodeReplicaReport(NamedTuple):
    """One decode replica's window: per-request TPOT samples plus batch and KV state."""

    tpot_s: tuple[float, ...]
    num_running: int
    num_waiting: int
    kv_cache_usage: float


class PrefillSignals(NamedTuple):
    """The prefill pool as the policy sees it."""

    ttft_p95_s: float | None
    queue_wait_p95_s: float | None
    num_pending_tokens: int
    num_ongoing_requests: int
    prefill_tokens_per_s: float
    busy_fraction: float
    num_replicas: int
    num_starting: int = 0
    arrived_tokens_per_s: float = 0.0

    @property
    def num_target(self) -> int:
        """Replicas serving or on their way: what a scale decision starts from."""
        return self.num_replicas + self.num_starting


class DecodeSignals(NamedTuple):
    """The decode pool as the policy sees it."""

    tpot_p95_s: float | None
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_replicas: int
    num_starting: int = 0

    @property
    def num_target(self) -> int:
        return self.num_replicas + self.num_starting


def aggregate_prefill(
    reports: Sequence[PrefillReplicaReport],
    q: float,
    num_starting: int = 0,
    router: RouterQueueReport | None = None,
) -> PrefillSignals:
    """Pool the samples of every serving replica; sum queues (the router's too); average speed
    over busy time."""
    router = router or RouterQueueReport()
    ttft = [v for r in reports for v in r.ttft_s]
    waits = [v for r in reports for v in r.queue_wait_s]
    busy = sum(r.busy_fraction for r in reports)
    # Speed is a property of the replica, load only weights it; a replica that has not
    # finished a batch yet (speed 0) has no say.
    measured = [r for r in reports if r.prefill_tokens_per_s > 0]
    weight = sum(r.busy_fraction for r in measured)
    if weight > 0:
        speed = sum(r.prefill_tokens_per_s * r.busy_fraction for r in measured) / weight
    else:
        speed = sum(r.prefill_tokens_per_s for r in measured) / len(measured) if measured else 0.0
    return PrefillSignals(
        ttft_p95_s=percentile(ttft, q),
        queue_wait_p95_s=percentile(waits, q),
        num_pending_tokens=sum(r.num_pending_tokens for r in reports) + router.num_queued_tokens,
        num_ongoing_requests=sum(r.num_ongoing_requests for r in reports)
        + router.num_queued_requests,
        prefill_tokens_per_s=speed,
        busy_fraction=busy / len(reports) if reports else 0.0,
        num_replicas=len(reports),
        num_starting=num_starting,
        arrived_tokens_per_s=router.arrived_tokens_per_s,
    )


def aggregate_decode(
    reports: Sequence[DecodeReplicaReport],
    q: float,
    num_starting: int = 0,
    num_router_waiting: int = 0,
) -> DecodeSignals:
    """Pool TPOT samples; sum running/waiting (the router's too); KV usage is the pool mean
    (replicas have equal capacity)."""
    tpot = [v for r in reports for v in r.tpot_s]
    return DecodeSignals(
        tpot_p95_s=percentile(tpot, q),
        num_running=sum(r.num_running for r in reports),
        num_waiting=sum(r.num_waiting for r in reports) + num_router_waiting,
        kv_cache_usage=sum(r.kv_cache_usage for r in reports) / len(reports) if reports else 0.0,
        num_replicas=len(reports),
        num_starting=num_starting,
    )
