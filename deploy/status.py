"""`pdserve status`: pools and replicas (Serve), recent latency percentiles (Redis)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from control.keys import POOLS
from control.records import DecisionRecord, PoolSLO
from control.sync_store import SyncControlStore
from deploy.local import LocalRun, load_run
from engine.messages import ReplicaLoad

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


async def _from_redis(redis_url: str, app: str) -> tuple[dict[str, list[float]], list[ReplicaLoad]]:
    """Latency samples the router recorded, and the replicas' last published load."""
    from control.store import ControlStore

    store = await ControlStore.connect(redis_url, app)
    try:
        samples = {m: await store.recent_samples(m, 1000) for m in METRICS}
        replicas = [r for pool in POOLS for r in await store.replica_loads(pool)]
        return samples, replicas
    finally:
        await store.close()


def format_replicas(replicas: Sequence[ReplicaLoad]) -> list[str]:
    lines = [
        f"  {'replica':<28}{'pending tok':>12}{'running':>9}{'waiting':>9}{'KV used':>9}"
        f"{'KV loads':>10}{'failed':>8}{'recomputed tok':>16}"
    ]
    for r in replicas:
        lines.append(
            f"  {r.replica_id:<28}{r.num_pending_prefill_tokens:>12}{r.num_running:>9}"
            f"{r.num_waiting:>9}{r.kv_usage:>8.0%}{r.num_kv_loads:>10}"
            f"{r.num_kv_load_failures:>8}{r.num_kv_recomputed_tokens:>16}"
        )
    return lines if replicas else ["  (no replica has reported yet)"]


def kv_load_warnings(replicas: Sequence[ReplicaLoad]) -> list[str]:
    """One warning line when any decode replica computed prompts whose KV should have been
    loaded: the transfer path is broken (unreachable producer, handshake, lost objects) and
    the app is paying for every prompt twice."""
    failures = sum(r.num_kv_load_failures for r in replicas)
    if not failures:
        return []
    loads = sum(r.num_kv_loads for r in replicas)
    tokens = sum(r.num_kv_recomputed_tokens for r in replicas)
    return [
        f"WARNING: {failures} of {loads} KV loads failed; decode recomputed {tokens} prompt "
        "tokens (see pdserve_kv_load_failures_total and the decode replicas' logs)"
    ]


def format_pools(
    samples: dict[str, list[float]],
    slo: PoolSLO | None,
    running: dict[str, int],
    pins: dict[str, int | None],
    decisions: Sequence[DecisionRecord],
) -> list[str]:
    """SLO vs observed P95 per pool, replicas running / target, pin."""
    lines = [f"  {'pool':<9}{'SLO (P95)':<16}{'observed P95':<16}{'replicas':<10}pin"]
    for pool, metric, name in (("prefill", "ttft", "TTFT"), ("decode", "tpot", "TPOT")):
        target_s = None if slo is None else getattr(slo, f"{metric}_p95_s")
        target = f"{name} {target_s * 1000:.0f}ms" if target_s else f"{name} (config)"
        values = samples.get(metric, [])
        seen = f"{name} {percentile(values, 95.0) * 1000:.0f}ms" if values else "-"
        last = next((d for d in decisions if d.pool == pool), None)
        now = running.get(pool.capitalize(), 0)
        replicas = f"{now}/{last.target_replicas if last else now}"
        pin = pins.get(pool)
        lines.append(f"  {pool:<9}{target:<16}{seen:<16}{replicas:<10}{pin if pin else 'auto'}")
    return lines


def format_decisions(decisions: Sequence[DecisionRecord]) -> list[str]:
    lines = []
    for d in decisions:
        at = time.strftime("%H:%M:%S", time.localtime(d.at))
        lines.append(f"  {at} {d.pool:<8}{d.current_replicas} -> {d.target_replicas}  {d.reason}")
    return lines or ["  (none yet)"]


def print_status(redis_url: str | None = None, app_name: str | None = None) -> int:
    """The local run's status; with `redis_url` and `app_name`, any app's control-plane view
    (replicas, KV loads, latencies, autoscaling) without Serve's replica states."""
    run = load_run() if redis_url is None or app_name is None else None
    if run is None and (redis_url is None or app_name is None):
        print("pdserve status: nothing is running (start it with `pdserve up`)")
        return 1
    running: dict[str, int] = {}
    if run is not None:
        redis_url, app_name = run.redis_url, run.app
        running = _print_serve_status(run)
    assert redis_url is not None and app_name is not None
    samples, replicas = asyncio.run(_from_redis(redis_url, app_name))
    with SyncControlStore.connect(redis_url, app_name) as store:
        decisions = store.recent_decisions(n=10)
        latest = [d for d in (store.last_decision(p) for p in ("prefill", "decode")) if d]
        pins = store.pins()
        slo = store.get_slo()
    for line in kv_load_warnings(replicas):
        print(line)
    print("autoscaling (prefill on TTFT, decode on TPOT)")
    for line in format_pools(samples, slo, running, pins, decisions):
        print(line)
    print("replicas (last report)")
    for line in format_replicas(replicas):
        print(line)
    print("last decisions (scale events and changes of reason)")
    for line in format_decisions(decisions):
        print(line)
    print("latest evaluation (every policy tick)")
    for line in format_decisions(latest):
        print(line)
    print("recent latencies (last 1000 requests)")
    for line in format_latencies(samples):
        print(line)
    return 0


def _print_serve_status(run: LocalRun) -> dict[str, int]:
    """Serve's view of the local run: app and replica states; RUNNING replicas by deployment."""
    run.use_ray_auth()
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
    if app is None:
        return {}
    print("  pool        replicas (state: count)")
    for name, deployment in app.deployments.items():
        states = ", ".join(f"{s}: {n}" for s, n in sorted(deployment.replica_states.items()))
        print(f"  {name:<12}{states}   {deployment.status}")
    return {n: int(d.replica_states.get("RUNNING", 0)) for n, d in app.deployments.items()}
