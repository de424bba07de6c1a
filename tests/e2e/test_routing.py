"""An app with a choice to make: 2 router, 2 prefill and 2 decode replicas, each pool on its own
host. Requests sharing a prefix land on one prefill replica through either router; decode goes
where the KV blocks are free; the metrics count exactly what was sent; a broken transfer is
counted and shown by `pdserve status`; a stream whose decode engine dies goes on elsewhere.
Replica ids come back in every response's timings.

The module's own app, so its metrics and counters hold only what these tests sent; the tests
run in file order and build on that.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from api.client import collect
from api.gen.pdserve.v1 import pdserve_pb2
from control.redis_server import RedisServer
from deploy.config import AppConfig
from engine.messages import GenerationRequest, ReplicaLoad
from engine.models import resolve_model
from engine.params import GenerationParams
from engine.prompts import load_tokenizer
from tests.e2e.conftest import (
    APP_TIMEOUT_S,
    ServedApp,
    ServeProxy,
    delete_app,
    engine_core_pid,
    on_host,
    replica_actor,
)
from tests.e2e.metrics import (
    metric_sum,
    scrape,
    settled_metric,
    wait_metric,
    wait_metric_at_least,
)

pytestmark = pytest.mark.engine

APP = "pd-route"
BLOCK = 32


@pytest.fixture(scope="module")
def route_app(serve_proxy: ServeProxy, redis_server: RedisServer) -> Iterator[ServedApp]:
    from ray.serve import api as serve_api

    from deploy.app import build_app
    from deploy.up import wait_serving

    two = {"num_replicas": 2, "min_replicas": 2, "max_replicas": 2, "num_cpus": 0.25}
    config = AppConfig.model_validate(
        {
            "name": APP,
            "engine": {"model": "tiny", "kv_cache_memory_bytes": 32 * 1024**2},
            "prefill": {**two, "cpu_cores": [0], "resources": on_host("c")},
            "decode": {**two, "cpu_cores": [1], "resources": on_host("a")},
            "router": {"num_replicas": 2, "default_max_tokens": 16, "resources": on_host("b")},
            "control": {"redis_url": redis_server.url},
            "autoscaling": {"enabled": False},
        }
    )
    app = ServedApp("route", config, serve_proxy.grpc_target, serve_proxy.http_port)
    serve_api._run(build_app(config), name=APP, route_prefix=f"/{APP}", _blocking=False)
    wait_serving(APP, APP_TIMEOUT_S)
    yield app
    delete_app(APP)  # its last test killed engines: replacements may still be starting


def _kv_bytes_per_token() -> int:
    """From the model's own config: 2 (K, V) x layers x KV heads x head size x 4 (float32); the
    same property gives 46,080 bytes for the default model (tests/unit/test_messages.py)."""
    from kv_transfer.layout import kv_layout_for
    from tests.builders import make_settings

    return kv_layout_for(make_settings(resolve_model("tiny"))).bytes_per_token


def test_metrics_count_exactly_what_was_sent(route_app: ServedApp) -> None:
    # Distinct prompts: the decode replicas hold none of their blocks, so each one moves whole.
    prompts = [f"metrics sample {i} {uuid.uuid4().hex} " * (i + 2) for i in range(5)]
    num_block_tokens = 0
    with route_app.client() as client:
        for prompt in prompts:
            done = collect(client.generate(prompt, max_tokens=4, ignore_eos=True))
            assert done.usage.completion_tokens == 4
            num_block_tokens += -(-done.usage.prompt_tokens // BLOCK) * BLOCK
    n = float(len(prompts))
    assert wait_metric("pdserve_ttft_seconds_count", n, app=APP) == n
    assert wait_metric("pdserve_requests_total", n, app=APP, outcome="ok") == n
    assert wait_metric("pdserve_kv_loads_total", n, app=APP, pool="decode", backend="nixl") == n
    # NIXL moves whole blocks: every token of every block the prompts filled, K and V.
    want = float(num_block_tokens * _kv_bytes_per_token())
    assert wait_metric("pdserve_kv_transfer_bytes_total", want, app=APP, backend="nixl") == want
    text = scrape()
    assert metric_sum(text, "pdserve_kv_load_failures_total", app=APP) == 0
    assert metric_sum(text, "pdserve_requests_total", app=APP, outcome="error") == 0


def test_a_shared_prefix_lands_on_one_prefill_replica_through_either_router(
    route_app: ServedApp,
) -> None:
    shared = "You are a careful assistant for the routing test. " * 12
    routers, prefills = set(), set()
    with route_app.client() as client:
        for i in range(16):
            done = collect(client.generate(f"{shared} Question {i}?", max_tokens=2))
            routers.add(done.timings.router_replica)
            prefills.add(done.timings.prefill_replica)
    assert len(routers) == 2, routers  # Serve's proxy spread the 16 calls over both routers
    assert len(prefills) == 1, prefills  # ...and both sent the shared prefix to one replica
    assert all(r.startswith("router-") for r in routers)
    assert next(iter(prefills)).startswith("prefill-")


def _wait_decode_loads(
    redis_server: RedisServer, done: Callable[[list[ReplicaLoad]], bool], timeout_s: float = 20
) -> list[ReplicaLoad]:
    from control.store import ControlStore

    async def read() -> list[ReplicaLoad]:
        store = await ControlStore.connect(redis_server.url, APP)
        try:
            return await store.replica_loads("decode")
        finally:
            await store.close()

    deadline = time.monotonic() + timeout_s
    while True:
        loads = asyncio.run(read())
        if done(loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


def test_decode_goes_where_the_kv_blocks_are_free(
    route_app: ServedApp, redis_server: RedisServer
) -> None:
    long_prompt = "a long conversation to hold decode blocks " * 24  # ~550 tokens
    first_decode: list[str] = []
    stop = threading.Event()

    def hold() -> None:  # a long request that keeps its blocks on one decode replica
        with route_app.client() as client:
            for chunk in client.generate(long_prompt, max_tokens=1400, ignore_eos=True):
                if chunk.timings.decode_replica and not first_decode:
                    first_decode.append(chunk.timings.decode_replica)
                if stop.is_set():
                    return

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not first_decode and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_decode, "the long request never reached a decode replica"

        # Its blocks show in its replica's reports (published each routing-stats period; the
        # running count can show a period before the free blocks do).
        def holder_shows(loads: list[ReplicaLoad]) -> bool:
            free = {x.replica_id: x.num_free_blocks for x in loads}
            return first_decode[0] in free and free[first_decode[0]] < max(free.values())

        loads = _wait_decode_loads(redis_server, holder_shows)
        busy = {x.replica_id: x.num_free_blocks for x in loads}
        assert busy[first_decode[0]] < max(busy.values()), busy
        time.sleep(2.0)  # and have reached the routers' view of the replicas
        with route_app.client() as client:
            done = collect(client.generate("a short question", max_tokens=2, ignore_eos=True))
        assert done.timings.decode_replica.startswith("decode-")
        assert done.timings.decode_replica != first_decode[0]
    finally:
        stop.set()
        holder.join(timeout=60)


async def test_a_broken_transfer_is_counted_and_shown(
    route_app: ServedApp, redis_server: RedisServer
) -> None:
    from ray import serve

    from deploy.local import free_port

    tokenizer = load_tokenizer(str(resolve_model("tiny")))
    prompt = tuple(tokenizer("a transfer that cannot arrive " * 8)["input_ids"])
    params = GenerationParams(max_tokens=6, ignore_eos=True)
    request = GenerationRequest(f"broken-{uuid.uuid4().hex[:8]}", prompt, params)
    prefill = serve.get_deployment_handle("Prefill", APP)
    decode = serve.get_deployment_handle("Decode", APP)
    result = await prefill.prefill.remote(request)
    # Decode is pointed at a producer it has never met, at a port where nothing listens (the
    # digest recomputed, so the handoff passes its checks): the NIXL handshake fails and decode
    # computes the prompt. (A known producer's engine id would reuse the earlier handshake.)
    wrong = replace(
        result.handoff.pull, remote_engine_id="prefill-nowhere", remote_port=free_port()
    )
    broken = replace(result.handoff, pull=wrong, digest="")
    try:
        tokens = [
            t
            async for event in decode.options(stream=True).decode.remote(request, broken)
            for t in event.token_ids
        ]
        assert len(tokens) == 5  # recomputed: the answer still comes (policy "recompute")
    finally:
        await decode.release.remote(result.handoff)
    failures = wait_metric_at_least("pdserve_kv_load_failures_total", 1, app=APP, pool="decode")
    assert failures == 1
    recomputed = metric_sum(scrape(), "pdserve_kv_recomputed_tokens_total", app=APP)
    assert recomputed == len(prompt) - 1
    status = _status(redis_server)
    assert status.returncode == 0, status.stderr
    warning = next(line for line in status.stdout.splitlines() if line.startswith("WARNING"))
    assert "1 of" in warning and f"recomputed {len(prompt) - 1} prompt tokens" in warning


def _status(redis_server: RedisServer) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + 30
    while True:  # the replica publishes its counters on the next routing-stats period
        done = subprocess.run(
            [sys.executable, "-m", "pdserve_cli", "status", "--redis-url", redis_server.url,
             "--app", APP],
            capture_output=True, text=True, timeout=60, check=False,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        if "WARNING" in done.stdout or time.monotonic() > deadline:
            return done
        time.sleep(1)


def _replica_actor(worker_id: str) -> Any:
    """The Serve replica actor of the decode replica `worker_id` names."""
    return replica_actor(APP, "Decode", worker_id)


def test_a_stream_whose_decode_engine_dies_goes_on_elsewhere_token_for_token(
    route_app: ServedApp,
) -> None:
    """Runs last: it kills an engine (Serve replaces its replica meanwhile). The EngineCore
    under the decode replica serving a stream is killed mid-stream; the client's one stream
    goes on from the other decode replica with the uninterrupted run's tokens, counted ok and
    as a migration; the dead replica reports itself unhealthy and gets no further request."""
    import os
    import signal

    import ray

    prompt = f"A stream that outlives its decode engine {uuid.uuid4().hex}. " * 3
    options: dict[str, Any] = {"max_tokens": 1500, "ignore_eos": True}  # greedy
    ok_before = settled_metric("pdserve_requests_total", app=APP, outcome="ok")
    with route_app.client() as client:
        reference = collect(client.generate(prompt, **options))
        tokens: list[int] = []
        killed, last, gaps, stats = "", None, [], None
        at = time.monotonic()
        for response in client.generate(prompt, **options):
            tokens.extend(response.token_ids)
            last = response
            gaps.append(time.monotonic() - at)
            at = time.monotonic()
            serving = response.timings.decode_replica
            if not killed and len(tokens) >= 32 and serving:
                killed = serving
                os.kill(engine_core_pid(_replica_actor(killed)), signal.SIGKILL)
            elif killed and stats is None and serving not in ("", killed):
                # Moved: the dead engine's replica says so in its routing stats (asked as
                # Serve asks them), while it lives (Serve stops it after 3 failed checks).
                stats = ray.get(_replica_actor(killed).record_routing_stats.remote(), timeout=30)
        assert killed, "the stream ended before an engine was killed"
        assert last is not None and last.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 1500
        assert tokens == list(reference.token_ids)
        assert last.timings.decode_replica not in ("", killed)
        print(f"\nlongest pause in the moved stream: {max(gaps[32:]):.2f} s")
        assert stats is not None and stats["is_healthy"] is False, stats
        after = [collect(client.generate(f"after {i}", max_tokens=4)) for i in range(6)]
    assert all(done.timings.decode_replica != killed for done in after)
    ok = wait_metric("pdserve_requests_total", ok_before + 8, app=APP, outcome="ok")
    assert ok == ok_before + 8
    assert metric_sum(scrape(), "pdserve_requests_total", app=APP, outcome="error") == 0
    assert wait_metric_at_least("pdserve_migrations_total", 1, app=APP) >= 1


def test_with_every_prefill_engine_dead_a_decode_replica_prefills_for_itself(
    route_app: ServedApp,
) -> None:
    """Runs after the decode kill: both prefill replicas' EngineCores are killed. A request
    fails on one prefill replica, then on the other, and is then prefilled on a decode replica
    itself: the client gets the greedy answer it got before, counted ok."""
    import os
    import signal

    import ray

    prompt = f"Prefill pool down {uuid.uuid4().hex}. " * 2
    options: dict[str, Any] = {"max_tokens": 24, "ignore_eos": True}
    prefix = f"SERVE_REPLICA::{APP}#Prefill#"
    # Read before the reference request, whose own count may reach the agents only after the
    # kill: the two requests are counted together.
    ok_before = settled_metric("pdserve_requests_total", app=APP, outcome="ok")
    with route_app.client() as client:
        reference = collect(client.generate(prompt, **options))
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)
        ]
        assert len(names) == 2, names
        for name in names:
            actor = ray.get_actor(name, namespace="serve")
            os.kill(engine_core_pid(actor), signal.SIGKILL)
        done = collect(client.generate(prompt, **options))
    assert list(done.token_ids) == list(reference.token_ids)
    assert done.timings.prefill_replica.startswith("decode")  # who computed the prompt
    assert wait_metric("pdserve_requests_total", ok_before + 2, app=APP, outcome="ok") == (
        ok_before + 2
    )
