"""The cluster launcher's recipe served through: deploy/cluster/ray-cluster.yaml's own start
commands on a head and two workers (network namespaces of this machine, tests/launcher.py),
its Redis on the head, token auth on every node, the control plane's URL in each node's
`ray start` environment, and deploy/configs/gpu-cluster.yaml deployed by the head with its
engines on CPU. Requests from another host reach the head's and a worker's proxies; the
prefill and decode engines run on different workers, so every prompt's KV crosses hosts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from api.client import PDServeClient, collect
from engine.local import LocalEngine
from prefill_workers.replica import unique_id_of
from tests.builders import make_greedy
from tests.hosts import HostsUnavailable, make_hosts
from tests.launcher import (
    DASHBOARD,
    HEAD,
    HOST_NAMES,
    WORKERS,
    LauncherCluster,
    start_launcher_cluster,
)

pytestmark = pytest.mark.engine

APP = "pdserve"  # the name gpu-cluster.yaml gives its app
# The router's prefix records in the control plane (control/store.py's key layout).
PREFIX_KEYS = f"pdserve:{APP}:prefix:*"
READY_WITHIN_S = 420
# Two blocks of the engines' 32 tokens: the prefill router records both in the prefix index.
PROMPT = "The launcher's head routes; its two workers prefill and decode. " * 4


@pytest.fixture(scope="module")
def launcher(tiny_model: Path) -> Iterator[LauncherCluster]:
    try:
        hosts = make_hosts(HOST_NAMES)
    except HostsUnavailable as exc:
        pytest.fail(f"cannot build the test hosts: {exc}")
    try:
        cluster = start_launcher_cluster(hosts, tiny_model)
        try:
            _wait_serving(cluster)
            yield cluster
        finally:
            cluster.shutdown()
    finally:
        hosts.remove()


def _wait_serving(cluster: LauncherCluster) -> None:
    """Until the head's gRPC proxy answers a generation (the engines load after the workers
    join: the head deployed the app before they existed)."""
    deadline = time.monotonic() + READY_WITHIN_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with PDServeClient(f"{cluster.head_ip}:9000", APP, timeout_s=30) as client:
                collect(client.generate("ready?", max_tokens=1))
            return
        except Exception as exc:  # not deployed yet, replicas starting
            last = exc
            time.sleep(3)
    status = cluster.bash(
        HEAD, f"{cluster.auth_env} $HOME/venv/bin/serve status --address {DASHBOARD}", 60
    )
    raise AssertionError(
        f"the launcher's app did not serve within {READY_WITHIN_S} s: {last}\n{status}"
    )


def test_the_launchers_cluster_serves_through_head_and_workers(
    launcher: LauncherCluster, tiny_engine: LocalEngine
) -> None:
    want = list(
        tiny_engine.generate([tiny_engine.encode(PROMPT)], make_greedy(16, ignore_eos=True))[
            0
        ].token_ids
    )
    # gRPC through the head's proxy, from host a (another host: nothing here is loopback).
    with PDServeClient(f"{launcher.head_ip}:9000", APP, timeout_s=120) as client:
        done = collect(client.generate(PROMPT, max_tokens=16, ignore_eos=True))
    assert list(done.token_ids) == want
    timings = done.timings
    assert timings.kv_transfer_s > 0, "the decode engine computed the prompt itself"

    # Where the app runs: one engine on each worker (their one GPU each); the two routers
    # (no resources of their own) wherever Serve spread them, each with the tokenizer there.
    replicas = launcher.actor_hosts("ServeReplica:")
    hosts_of = {
        pool: sorted(host for name, host in replicas.items() if f"#{pool}#" in name)
        for pool in ("Router", "Prefill", "Decode")
    }
    assert len(hosts_of["Router"]) == 2, replicas
    assert len(hosts_of["Prefill"]) == len(hosts_of["Decode"]) == 1, replicas
    assert sorted(hosts_of["Prefill"] + hosts_of["Decode"]) == sorted(WORKERS), replicas
    prefill, decode = (
        next(name for name in replicas if name.endswith("#" + unique_id_of(worker)))
        for worker in (timings.prefill_replica, timings.decode_replica)
    )
    assert replicas[prefill] != replicas[decode]

    # OpenAI HTTP through a worker's proxy (proxy_location: EveryNode), same tokens.
    response = httpx.post(
        f"http://{launcher.hosts.ip(WORKERS[0])}:8000/v1/completions",
        json={
            "model": "qwen2.5-7b-instruct",
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == done.text

    # The routers reached the head's Redis through the URL in their node's `ray start`
    # environment (never in the Serve config): the prompt's blocks are in the prefix index.
    store = redis.Redis(host=launcher.head_ip, port=6380, password=launcher.redis_password)
    try:
        assert len(list(store.scan_iter(PREFIX_KEYS))) >= 2
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=launcher.head_ip, port=6380).ping()
    finally:
        store.close()
