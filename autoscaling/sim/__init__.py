"""The discrete-event P/D simulator the decisions are tested and compared on (docs/autoscaling.md).

| module | what it holds |
|---|---|
| `profiles.py` | replica service-time models (`CPU_FP32_1CORE`, `CPU_BF16_1CORE`, `GPU_LIKE`) |
| `trace.py` | seeded arrival traces (piecewise rate, length ranges) |
| `pool_policies.py` | `PoolPolicies`: one decision function per pool, as the simulator calls them |
| `baseline.py` | Ray Serve's queue-length policy, for comparison |
| `replicas.py`, `pools.py`, `simulator.py`, `results.py` | the simulator |
| `report.py` | `python -m autoscaling.sim.report`: our policy vs the baseline |

Pure, like the decisions: no ray, vllm, redis or grpc.
"""
