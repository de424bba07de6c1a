"""Autoscaling knobs: every threshold of the decisions, and the default SLO and bounds.

`AutoscalingConfig` is frozen and validated on construction, so a decision function never sees
a negative delay. The SLO a pool is held to and its replica bounds (`PoolSLO`, `ReplicaBounds`)
are the operator's settings, stored in the control plane: they live in `control/records.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from control.records import PoolSLO, ReplicaBounds


@dataclass(frozen=True)
class AutoscalingConfig:
    """Every threshold the decision functions use, with the defaults they were tuned at.

    Times are seconds. "Margin" values are fractions of the SLO; "usage" values of capacity.
    """

    # Signals: which percentile of which window the replicas report.
    percentile: float = 95.0
    window_s: float = 60.0
    tick_s: float = 10.0
    # Up: fire when the queue predicts TTFT above this share of the SLO (before P95 breaches),
    # and size a scale-up to bring the predicted TTFT / TPOT back under this share.
    slo_headroom: float = 0.8
    # Up: size the prefill pool so each replica is busy at most this share of the time.
    target_utilization: float = 0.8
    # Up: never more than this factor of the current replicas in one decision (at least +1).
    max_upscale_factor: float = 4.0
    # Up: at least this long between two scale-ups (new replicas need time to start).
    upscale_cooldown_s: float = 20.0
    # Decode up: KV-cache usage above this is a breach; size the pool to bring it to target.
    kv_usage_high: float = 0.85
    kv_usage_target: float = 0.7
    # Decode up: waiting sequences must have been > 0 this long to count as a breach.
    waiting_sustain_s: float = 20.0
    # Up: a prefill backlog is sized to drain over this long (about a replica's start-up: it
    # cannot drain sooner than new replicas come up).
    backlog_drain_s: float = 60.0
    # Down, one replica at a time: P95 below slo * margin and one replica fewer keeping
    # utilization / KV usage below the levels here, held for `downscale_delay_s` (restarted by
    # a scale-up), and at least `downscale_cooldown_s` after the previous scale event.
    downscale_margin: float = 0.6
    downscale_delay_s: float = 120.0
    downscale_cooldown_s: float = 30.0
    downscale_utilization: float = 0.4
    kv_usage_low: float = 0.5
    # How many past scale events the history keeps.
    history_length: int = 16
    # Grow a pool by a role flip before starting replicas (autoscaling/roles.py), at most one
    # flip per this many ticks per pool.
    flip_first: bool = True
    flip_interval_ticks: float = 3.0
    # Between scale events, flip engines so the split follows the measured prefill share of the
    # work (autoscaling/roles.py plan_split; needs flip_first).
    split_follows_work: bool = True
    # The fewest engines the split keeps serving prefill: 0 lends the last one to decoding,
    # where the router computes every prompt locally, while no prompt would stall the streams
    # past the TPOT SLO (an adaptive router only: deploy/config.py; roles.py says how).
    split_min_prefill_engines: int = 1
    # The most a prompt computed locally may add to one gap before that split takes a prefill
    # engine back: the app's ITL SLO where the router has one (router.adaptive_itl_s), else
    # (None) the TPOT SLO, as the router's one-token stall rule bounds a gap.
    split_stall_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.split_stall_limit_s is not None and not self.split_stall_limit_s > 0:
            raise ValueError(f"split_stall_limit_s must be > 0, got {self.split_stall_limit_s}")
        if self.split_min_prefill_engines not in (0, 1):
            raise ValueError(
                f"split_min_prefill_engines must be 0 or 1, got {self.split_min_prefill_engines}"
            )
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        for name in ("window_s", "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "upscale_cooldown_s",
            "backlog_drain_s",
            "waiting_sustain_s",
            "downscale_delay_s",
            "downscale_cooldown_s",
            "flip_interval_ticks",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "slo_headroom",
            "target_utilization",
            "kv_usage_high",
            "kv_usage_target",
            "downscale_margin",
            "downscale_utilization",
            "kv_usage_low",
        ):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.max_upscale_factor < 1:
            raise ValueError(f"max_upscale_factor must be >= 1, got {self.max_upscale_factor}")
        if not self.kv_usage_low < self.kv_usage_target <= self.kv_usage_high:
            raise ValueError("KV usage thresholds must satisfy low < target <= high")
        if self.history_length < 1:
            raise ValueError(f"history_length must be >= 1, got {self.history_length}")


DEFAULT_CONFIG = AutoscalingConfig()
DEFAULT_SLO = PoolSLO()
DEFAULT_BOUNDS = ReplicaBounds()
