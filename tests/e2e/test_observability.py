"""What operators see: Prometheus metrics through Ray's metrics agent, the prefix index the
router replicas share through Redis, and the latency samples and replica loads `pdserve status`
reads."""

from __future__ import annotations

import time
import urllib.request

import pytest

from api.client import collect
from control.redis_server import RedisServer
from control.store import ControlStore
from engine.local import LocalEngine
from router.prefix import block_hashes
from tests.e2e.conftest import ServedApp

pytestmark = pytest.mark.engine

LONG_PROMPT = "shared system prompt for prefix affinity " * 12


def _metrics_text() -> str:
    import ray

    texts = []
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                texts.append(response.read().decode())
    return "\n".join(texts)


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
        text = _metrics_text()
        if all(name in text for name in wanted) and ok_count(text) >= 3:
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, missing
    totals = [line for line in text.splitlines() if "pdserve_requests_total" in line]
    assert ok_count(text) >= 3, totals


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
