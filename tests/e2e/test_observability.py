"""What operators see: Prometheus metrics through Ray's metrics agent (pdserve's, vLLM's engine
metrics labelled by app, pool and replica, and every metric the Grafana dashboard in
deploy/grafana/ queries), the prefix index the router replicas share through Redis, and the
latency samples and replica loads `pdserve status` reads."""

from __future__ import annotations

import time

import pytest

from api.client import collect
from control.redis_server import RedisServer
from control.store import ControlStore
from engine.local import LocalEngine
from router.prefix import block_hashes
from tests.e2e.conftest import ServedApp
from tests.e2e.metrics import scrape
from tests.grafana import exported_names, load_dashboard, metric_names, queries

pytestmark = pytest.mark.engine

LONG_PROMPT = "shared system prompt for prefix affinity " * 12


def test_prometheus_metrics_are_exported(serve_apps: dict[str, ServedApp]) -> None:
    app = serve_apps["nixl"]
    with app.client() as client:
        for _ in range(3):
            collect(client.generate("metrics please", max_tokens=6, ignore_eos=True))
    wanted = [
        "pdserve_ttft_seconds_count",
        "pdserve_tpot_seconds_count",
        "pdserve_queue_wait_seconds_count",
        "pdserve_prefill_seconds_count",
        "pdserve_kv_transfer_seconds_count",
        "pdserve_requests_total",
        "pdserve_kv_transfer_bytes_total",
    ]

    def ok_count(text: str) -> float:
        # Ray's exporter may prefix the name (ray_pdserve_...); one line per app and outcome.
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if "pdserve_requests_total{" in line
            and 'outcome="ok"' in line
            and 'app="pd-nixl"' in line
        )

    # The agent exports on its own period: a name can show before all three requests count.
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = scrape()
        if all(name in text for name in wanted) and ok_count(text) >= 3:
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, missing
    totals = [line for line in text.splitlines() if "pdserve_requests_total" in line]
    assert ok_count(text) >= 3, totals


def test_grafana_dashboard_queries_only_exported_metrics(
    serve_apps: dict[str, ServedApp],
) -> None:
    """Every metric a query of deploy/grafana/pdserve.json names is in the running apps'
    scrape after a request went through each (both KV backends and the colocated engine), by
    the name Ray exports; vLLM's engine metrics carry the pool and the app."""
    for app in serve_apps.values():
        with app.client() as client:
            done = collect(client.generate("dashboard please", max_tokens=6, ignore_eos=True))
        assert len(done.token_ids) == 6, (app.name, done)
    wanted = set().union(*map(metric_names, queries(load_dashboard())))
    assert len(wanted) > 10, wanted

    # The agents export on their own period: poll until every name has shown.
    deadline = time.monotonic() + 90
    while True:
        text = scrape()
        missing = wanted - exported_names(text)
        unlabelled = {name: _engines_without(text, name) for name in ENGINE_SERIES}
        if time.monotonic() > deadline or not (missing or any(unlabelled.values())):
            break
        time.sleep(2)
    ours = sorted(n for n in exported_names(text) if n.startswith(("ray_pdserve", "ray_vllm")))
    assert not missing, f"not exported: {sorted(missing)}; exported: {ours}"
    # vLLM's engine metrics come from every engine replica, labelled by app, pool and replica.
    assert not any(unlabelled.values()), unlabelled
    for name in ENGINE_SERIES:
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert all('ReplicaId=""' not in line for line in lines), lines


# Every engine of the package's apps, by (app, pool).
ENGINES = {
    ("pd-nixl", "prefill"),
    ("pd-nixl", "decode"),
    ("pd-ray", "prefill"),
    ("pd-ray", "decode"),
    ("colocated", "engine"),
}
# A histogram every finished request lands in, and a gauge the replicas keep fresh.
ENGINE_SERIES = ("ray_vllm_e2e_request_latency_seconds_count", "ray_vllm_kv_cache_usage_perc")


def _engines_without(text: str, name: str) -> set[tuple[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    return {
        (app, pool)
        for app, pool in ENGINES
        if not any(f'app="{app}"' in line and f'pool="{pool}"' in line for line in lines)
    }


async def test_prefix_index_and_samples_are_shared_through_redis(
    serve_apps: dict[str, ServedApp], redis_server: RedisServer, tiny_engine: LocalEngine
) -> None:
    app = serve_apps["nixl"]
    async with app.aclient() as client:
        await client.complete(LONG_PROMPT, max_tokens=2)
    prompt_ids = tiny_engine.encode(LONG_PROMPT)
    hashes = block_hashes(prompt_ids, 32)
    assert len(hashes) >= 2
    store = await ControlStore.connect(redis_server.url, app.name)
    try:
        owners = await store.prefix_owners(hashes)
        # The router's request router recorded the chosen prefill replica for every full block.
        assert owners[0] is not None and set(owners) == {owners[0]}
        samples = await store.recent_samples("ttft", 1000)
        assert samples and all(0 < s < 60 for s in samples)
        # Each pool's replicas publish their load (what `pdserve status` lists).
        for pool in ("prefill", "decode"):
            loads = await store.replica_loads(pool)
            assert loads and all(load.pool == pool for load in loads), pool
    finally:
        await store.close()
