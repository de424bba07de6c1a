"""`pdserve status`: pools and replicas (Serve), recent latency percentiles (Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from deploy.local import LocalRun, load_run

PERCENTILES = (50.0, 95.0, 99.0)
METRICS = ("ttft", "tpot", "queue_wait", "prefill", "kv_transfer")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), of a non-empty sequence."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def format_latencies(samples: dict[str, list[float]]) -> list[str]:
    lines = [f"  {'metric':<12}{'n':>6}" + "".join(f"{f'p{q:g}':>10}" for q in PERCENTILES)]
    for metric in METRICS:
        values = samples.get(metric, [])
        if not values:
            lines.append(f"  {metric:<12}{0:>6}" + "".join(f"{'-':>10}" for _ in PERCENTILES))
            continue
        cells = "".join(f"{percentile(values, q) * 1000:>8.0f}ms" for q in PERCENTILES)
        lines.append(f"  {metric:<12}{len(values):>6}{cells}")
    return lines


async def _samples(run: LocalRun) -> dict[str, list[float]]:
    from deploy.control.store import ControlStore

    store = await ControlStore.connect(run.redis_url, run.app)
    try:
        return {m: await store.recent_samples(m, 1000) for m in METRICS}
    finally:
        await store.close()


def print_status() -> int:
    run = load_run()
    if run is None:
        print("pdserve status: nothing is running (start it with `pdserve up`)")
        return 1
    import os

    from deploy.local import RAY_AUTH_ENV

    os.environ.update(RAY_AUTH_ENV)  # before Ray is imported: it reads its auth mode once
    import ray
    from ray import serve

    ray.init(
        address=run.ray_address, namespace="pdserve", logging_level="ERROR", log_to_driver=False
    )
    try:
        app = serve.status().applications.get(run.app)
    finally:
        ray.shutdown()
    print(
        f"app {run.app}: {app.status if app else 'MISSING'}   "
        f"gRPC {run.grpc_target}   HTTP {run.http_url}"
    )
    if app is not None:
        print("  pool        replicas (state: count)")
        for name, deployment in app.deployments.items():
            states = ", ".join(f"{s}: {n}" for s, n in sorted(deployment.replica_states.items()))
            print(f"  {name:<12}{states}   {deployment.status}")
    print("recent latencies (last 1000 requests)")
    for line in format_latencies(asyncio.run(_samples(run))):
        print(line)
    return 0
