"""Per-pool autoscaling, the pure part: prefill scales on TTFT, decode on TPOT and KV usage.

| module | what it holds |
|---|---|
| `config.py` | `PoolSLO`, `ReplicaBounds`, `AutoscalingConfig` (every threshold, with defaults) |
| `signals.py` | replica reports, pool signals, `percentile` / `window_percentile`, aggregation |
| `history.py` | `ScalingHistory` (immutable), `ScaleEvent` |
| `policy.py` | `decide_prefill`, `decide_decode` -> `Decision` |
| `baseline.py` | Ray Serve's queue-length policy, for comparison |
| `profiles.py` | replica service-time models (`CPU_FP32_1CORE`, `CPU_BF16_1CORE`, `GPU_LIKE`) |
| `trace.py` | seeded arrival traces (piecewise rate, length ranges) |
| `pool_policies.py` | `PoolPolicies`: one decision function per pool, as the simulator calls them |
| `replicas.py`, `pools.py`, `simulator.py`, `results.py` | the discrete-event P/D simulator |
| `report.py` | `python -m deploy.autoscaling.report`: our policy vs the baseline |

Nothing here imports ray, vllm, redis or grpc.
"""

from __future__ import annotations

from deploy.autoscaling.config import AutoscalingConfig, PoolSLO, ReplicaBounds
from deploy.autoscaling.history import ScaleEvent, ScalingHistory
from deploy.autoscaling.policy import Decision, decide_decode, decide_prefill
from deploy.autoscaling.signals import (
    DecodeReplicaReport,
    DecodeSignals,
    PrefillReplicaReport,
    PrefillSignals,
    RouterQueueReport,
    aggregate_decode,
    aggregate_prefill,
    percentile,
    window_percentile,
)

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
