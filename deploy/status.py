"""`pdserve status`: pools and replicas (Serve), recent latency percentiles (Redis).

collect_status gathers one StatusReport (Serve's states through Ray, the rest from the control
plane); format_status renders it for people, status_json for scripts (`--json`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from control.keys import LOCAL_PREFILL_METRIC, POOLS
from control.records import DecisionRecord, PoolSLO, RoleTable
from control.sync_store import SyncControlStore
from deploy.local import LocalRun, load_run
from engine.autoscaling_stats import percentile_of
from engine.messages import ReplicaLoad

PERCENTILES = (50.0, 95.0, 99.0)
METRICS = ("ttft", "tpot", "queue_wait", "prefill", "kv_transfer")


def prefill_split(samples: Mapping[str, list[float]]) -> tuple[int, float] | None:
    """Of the last disaggregated requests: how many, and the share whose prompt was computed
    on the decode replica itself. None before the first."""
    values = samples.get(LOCAL_PREFILL_METRIC, [])
    return (len(values), sum(values) / len(values)) if values else None


def format_split(samples: Mapping[str, list[float]]) -> list[str]:
    split = prefill_split(samples)
    if split is None:
        return ["  (no disaggregated request yet)"]
    n, local = split
    return [f"  last {n} requests: {local:.0%} on their decode replica, {1 - local:.0%} remote"]


def format_latencies(samples: dict[str, list[float]]) -> list[str]:
    lines = [f"  {'metric':<12}{'n':>6}" + "".join(f"{f'p{q:g}':>10}" for q in PERCENTILES)]
    for metric in METRICS:
        values = samples.get(metric, [])
        if not values:
            lines.append(f"  {metric:<12}{0:>6}" + "".join(f"{'-':>10}" for _ in PERCENTILES))
            continue
        cells = "".join(f"{percentile_of(values, q) * 1000:>8.0f}ms" for q in PERCENTILES)
        lines.append(f"  {metric:<12}{len(values):>6}{cells}")
    return lines


async def _from_redis(redis_url: str, app: str) -> tuple[dict[str, list[float]], list[ReplicaLoad]]:
    """Latency samples the router recorded, and the replicas' last published load."""
    from control.store import ControlStore

    store = await ControlStore.connect(redis_url, app)
    try:
        samples = {m: await store.recent_samples(m, 1000) for m in (*METRICS, LOCAL_PREFILL_METRIC)}
        replicas = [r for pool in POOLS for r in await store.replica_loads(pool)]
        return samples, replicas
    finally:
        await store.close()


def format_replicas(replicas: Sequence[ReplicaLoad], roles: RoleTable | None = None) -> list[str]:
    """One row a replica; `takes` is the pool whose calls it takes (a role flip: `pdserve role`)."""
    roles = roles or RoleTable()
    lines = [
        f"  {'replica':<28}{'takes':>8}{'engine':>8}{'pending tok':>12}{'running':>9}{'waiting':>9}"
        f"{'KV used':>9}{'KV loads':>10}{'failed':>8}{'recomputed tok':>16}"
    ]
    for r in replicas:
        lines.append(
            f"  {r.replica_id:<28}{roles.role_of(r.replica_id):>8}"
            f"{'ok' if r.is_healthy else 'DEAD':>8}"
            f"{r.num_pending_prefill_tokens:>12}{r.num_running:>9}"
            f"{r.num_waiting:>9}{r.kv_usage:>8.0%}{r.num_kv_loads:>10}"
            f"{r.num_kv_load_failures:>8}{r.num_kv_recomputed_tokens:>16}"
        )
    return lines if replicas else ["  (no replica has reported yet)"]


def health_warnings(replicas: Sequence[ReplicaLoad]) -> list[str]:
    """One line per replica whose engine died: the routers skip it, and Serve replaces it once
    its health checks fail (3 checks, 10 s apart)."""
    return [
        f"WARNING: {r.replica_id}'s engine died; the routers skip it until Serve replaces it"
        for r in replicas
        if not r.is_healthy
    ]


def status_warnings(replicas: Sequence[ReplicaLoad]) -> list[str]:
    """What `pdserve status` warns of, in text and in --json: dead engines, failed KV loads."""
    return health_warnings(replicas) + kv_load_warnings(replicas)


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


@dataclass(frozen=True)
class PoolRow:
    """One pool's line: its SLO and observed P95 (seconds), replicas running and targeted."""

    pool: str
    metric: str
    slo_p95_s: float | None
    observed_p95_s: float | None
    num_running: int
    target_replicas: int
    pin: int | None


def pool_rows(
    samples: Mapping[str, list[float]],
    slo: PoolSLO | None,
    running: Mapping[str, int],
    pins: Mapping[str, int | None],
    decisions: Sequence[DecisionRecord],
) -> list[PoolRow]:
    rows = []
    for pool, metric in (("prefill", "ttft"), ("decode", "tpot")):
        values = samples.get(metric, [])
        last = next((d for d in decisions if d.pool == pool), None)
        now = running.get(pool.capitalize(), 0)
        rows.append(
            PoolRow(
                pool=pool,
                metric=metric,
                slo_p95_s=None if slo is None else getattr(slo, f"{metric}_p95_s"),
                observed_p95_s=percentile_of(values, 95.0) if values else None,
                num_running=now,
                target_replicas=last.target_replicas if last else now,
                pin=pins.get(pool),
            )
        )
    return rows


def format_pools(rows: Sequence[PoolRow]) -> list[str]:
    """SLO vs observed P95 per pool, replicas running / target, pin."""
    lines = [f"  {'pool':<9}{'SLO (P95)':<16}{'observed P95':<16}{'replicas':<10}pin"]
    for r in rows:
        name = r.metric.upper()
        target = f"{name} {r.slo_p95_s * 1000:.0f}ms" if r.slo_p95_s else f"{name} (config)"
        seen = f"{name} {r.observed_p95_s * 1000:.0f}ms" if r.observed_p95_s is not None else "-"
        replicas = f"{r.num_running}/{r.target_replicas}"
        lines.append(f"  {r.pool:<9}{target:<16}{seen:<16}{replicas:<10}{r.pin or 'auto'}")
    return lines


def format_decisions(decisions: Sequence[DecisionRecord]) -> list[str]:
    lines = []
    for d in decisions:
        at = time.strftime("%H:%M:%S", time.localtime(d.at))
        lines.append(f"  {at} {d.pool:<8}{d.current_replicas} -> {d.target_replicas}  {d.reason}")
    return lines or ["  (none yet)"]


@dataclass(frozen=True)
class DeploymentState:
    status: str
    replica_states: dict[str, int]


@dataclass(frozen=True)
class StatusReport:
    """Everything `pdserve status` shows. `run` and `serve` are None for an app given by
    --redis-url (no local run); `serve` is also None while Serve does not know the app."""

    app: str
    run: LocalRun | None
    app_status: str
    serve: dict[str, DeploymentState] | None
    samples: dict[str, list[float]]
    replicas: list[ReplicaLoad]
    decisions: list[DecisionRecord]
    latest: list[DecisionRecord]
    pins: dict[str, int | None]
    slo: PoolSLO | None
    roles: RoleTable = field(default_factory=RoleTable)

    @property
    def pools(self) -> list[PoolRow]:
        running = {n: d.replica_states.get("RUNNING", 0) for n, d in (self.serve or {}).items()}
        return pool_rows(self.samples, self.slo, running, self.pins, self.decisions)


def state_name(state: object) -> str:
    """Serve's status enums print as "ReplicaState.RUNNING" or "RUNNING" depending on their
    kind; their value is the name."""
    return str(getattr(state, "value", state))


def collect_status(
    redis_url: str | None = None, app_name: str | None = None
) -> StatusReport | None:
    """The local run's status; with `redis_url` and `app_name`, any app's control-plane view
    (replicas, KV loads, latencies, autoscaling) without Serve's replica states. None when
    there is nothing to show."""
    run = load_run() if redis_url is None or app_name is None else None
    if run is None and (redis_url is None or app_name is None):
        return None
    app_status, serve = "", None
    if run is not None:
        redis_url, app_name = run.redis_url, run.app
        app_status, serve = _serve_states(run)
    assert redis_url is not None and app_name is not None
    samples, replicas = asyncio.run(_from_redis(redis_url, app_name))
    with SyncControlStore.connect(redis_url, app_name) as store:
        decisions = store.recent_decisions(n=10)
        latest = [d for d in (store.last_decision(p) for p in ("prefill", "decode")) if d]
        pins = store.pins()
        slo = store.get_slo()
        roles = store.role_table()
    return StatusReport(
        app_name, run, app_status, serve, samples, replicas, decisions, latest, pins, slo, roles
    )


def format_status(report: StatusReport) -> list[str]:
    lines = []
    run = report.run
    if run is not None:
        lines.append(
            f"app {run.app}: {report.app_status}   gRPC {run.grpc_target}   HTTP {run.http_url}"
        )
        if run.dashboard_url:
            lines.append(
                f"  Ray GCS {run.ray_address}   dashboard {run.dashboard_url}   "
                '(serve status, ray status: eval "$(pdserve env)" first)'
            )
    if report.serve is not None:
        lines.append("  pool        replicas (state: count)")
        for name, deployment in report.serve.items():
            states = ", ".join(f"{s}: {n}" for s, n in sorted(deployment.replica_states.items()))
            lines.append(f"  {name:<12}{states}   {deployment.status}")
    lines += status_warnings(report.replicas)
    lines.append("autoscaling (prefill on TTFT, decode on TPOT)")
    lines += format_pools(report.pools)
    lines.append("replicas (last report)")
    lines += format_replicas(report.replicas, report.roles)
    lines.append("last decisions (scale events and changes of reason)")
    lines += format_decisions(report.decisions)
    lines.append("latest evaluation (every policy tick)")
    lines += format_decisions(report.latest)
    lines.append("recent latencies (last 1000 requests)")
    lines += format_latencies(report.samples)
    lines.append("where prompts were prefilled")
    lines += format_split(report.samples)
    return lines


def status_json(report: StatusReport) -> dict[str, object]:
    """The report for scripts: seconds and counts as numbers, no formatting."""
    run = report.run
    endpoints = None
    if run is not None:
        endpoints = {
            "grpc": run.grpc_target,
            "http": run.http_url,
            "ray_address": run.ray_address,
            "ray_dashboard": run.dashboard_url or None,
            "ray_token_path": run.ray_token_path,
        }
    latencies = {
        metric: {"n": len(values)}
        | {f"p{q:g}_s": percentile_of(values, q) if values else None for q in PERCENTILES}
        for metric, values in ((m, report.samples.get(m, [])) for m in METRICS)
    }
    return {
        "app": report.app,
        "status": report.app_status or None,
        "endpoints": endpoints,
        "deployments": None
        if report.serve is None
        else {name: asdict(d) for name, d in report.serve.items()},
        "pools": [asdict(r) for r in report.pools],
        "replicas": [
            asdict(r) | {"takes": report.roles.role_of(r.replica_id)} for r in report.replicas
        ],
        "roles": {"version": report.roles.version, "flipped": dict(report.roles.flipped)},
        "warnings": status_warnings(report.replicas),
        "decisions": [asdict(d) for d in report.decisions],
        "latest": [asdict(d) for d in report.latest],
        "latencies": latencies,
        "prefill_split": None
        if (split := prefill_split(report.samples)) is None
        else {"n": split[0], "local_share": split[1]},
    }


def print_status(
    redis_url: str | None = None, app_name: str | None = None, as_json: bool = False
) -> int:
    report = collect_status(redis_url, app_name)
    if report is None:
        print("pdserve status: nothing is running (start it with `pdserve up`)")
        return 1
    if as_json:
        print(json.dumps(status_json(report), indent=2))
    else:
        print("\n".join(format_status(report)))
    return 0


def _serve_states(run: LocalRun) -> tuple[str, dict[str, DeploymentState] | None]:
    """Serve's view of the local run: the app's status and each deployment's replica states
    ("MISSING", None while Serve does not know the app)."""
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
    if app is None:
        return "MISSING", None
    return state_name(app.status), {
        name: DeploymentState(
            state_name(d.status), {state_name(s): int(n) for s, n in d.replica_states.items()}
        )
        for name, d in app.deployments.items()
    }
