"""Per-pool autoscaling, the pure part: prefill scales on TTFT, decode on TPOT and KV usage.

| module | what it holds |
|---|---|
| `config.py` | `PoolSLO`, `ReplicaBounds`, `AutoscalingConfig` (every threshold, with defaults) |
| `signals.py` | replica reports, pool signals, `window_percentile`, aggregation |
| `history.py` | `ScalingHistory` (immutable), `ScaleEvent` |
| `policy.py` | `decide_prefill`, `decide_decode` -> `Decision` |
| `sim/` | the discrete-event P/D simulator, the baseline policy and the report |

Nothing here imports ray, vllm, redis or grpc.
"""

from __future__ import annotations

from autoscaling.config import AutoscalingConfig
from autoscaling.history import ScaleEvent, ScalingHistory
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
from engine.autoscaling_stats import percentile

__all__ = [
    "AutoscalingConfig",
    "Decision",
    "DecodeReplicaReport",
    "DecodeSignals",
    "PoolSLO",
    "PrefillReplicaReport",
    "PrefillSignals",
    "ReplicaBounds",
    "RouterQueueReport",
    "ScaleEvent",
    "ScalingHistory",
    "aggregate_decode",
    "aggregate_prefill",
    "decide_decode",
    "decide_prefill",
    "percentile",
    "window_percentile",
]
