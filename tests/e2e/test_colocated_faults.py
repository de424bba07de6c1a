"""The colocated topology's migration, served: an app of two engine replicas (tiny model, each
on a host of its own). The EngineCore under the replica serving a long greedy stream is
killed at its first tokens; the client's one stream goes on from the other replica (the prompt
plus the tokens delivered start again there, router/lifecycle.py) with the uninterrupted run's
tokens.

The module's own app: it kills an engine, so no other module's requests meet the dead one. Its
two replicas share cores 0 and 1, one each (`cores_per_replica`): checked first."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from api.client import collect
from api.gen.pdserve.v1 import pdserve_pb2
from deploy.config import AppConfig
from tests.e2e.conftest import (
    APP_TIMEOUT_S,
    ServedApp,
    ServeProxy,
    engine_core_pid,
    on_host,
    replica_actor,
    replica_actors,
    replica_pid,
)
from tests.e2e.metrics import wait_metric_at_least
from tests.procs import descendants, pinned_cores

pytestmark = pytest.mark.engine

APP = "colo-faults"
# The prompt (186 tokens in the tiny model's tokenizer) and this fit its 2,048-token context.
MAX_TOKENS = 1800


@pytest.fixture(scope="module")
def colocated_pair(serve_proxy: ServeProxy) -> Iterator[ServedApp]:
    from ray import serve
    from ray.serve import api as serve_api

    from deploy.app import build_app
    from deploy.up import wait_serving

    config = AppConfig.model_validate(
        {
            "name": APP,
            "topology": "colocated",
            "engine": {"model": "tiny", "kv_cache_memory_bytes": 32 * 1024**2},
            "colocated": {
                "num_replicas": 2,
                "min_replicas": 2,
                "max_replicas": 2,
                "num_cpus": 0.25,
                "cpu_cores": [0, 1],
                "cores_per_replica": 1,
                "resources": on_host("c"),
            },
            "router": {"default_max_tokens": 16, "resources": on_host("b")},
            "autoscaling": {"enabled": False},
        }
    )
    serve_api._run(build_app(config), name=APP, route_prefix=f"/{APP}", _blocking=False)
    wait_serving(APP, APP_TIMEOUT_S)
    yield ServedApp("colocated-pair", config, serve_proxy.grpc_target, serve_proxy.http_port)
    serve.delete(APP)


def test_each_replica_computes_on_a_core_of_its_own(colocated_pair: ServedApp) -> None:
    """The pool's cores [0, 1], one per replica (`cores_per_replica`, engine/cores.py): the
    engine threads under each replica are bound to its own core, not both to both."""
    actors = replica_actors(APP, "Engine")
    assert len(actors) == 2, actors
    bound = {worker: pinned_cores(descendants([replica_pid(a)])) for worker, a in actors.items()}
    assert sorted(map(sorted, bound.values())) == [[0], [1]], bound


def test_a_stream_whose_engine_dies_goes_on_on_the_other_replica(
    colocated_pair: ServedApp,
) -> None:
    prompt = f"A colocated stream that outlives its engine {uuid.uuid4().hex}. " * 3
    # Greedy, and as long as the context allows: the engine must still be generating when the
    # client, which reads behind it on a loaded machine, sees the first tokens and kills it
    # (a clean-clone run once killed an engine that had already finished: no move, no count).
    options: dict[str, Any] = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    with colocated_pair.client() as client:
        reference = collect(client.generate(prompt, **options))
        tokens: list[int] = []
        killed, last = "", None
        for response in client.generate(prompt, **options):
            tokens.extend(response.token_ids)
            last = response
            serving = response.timings.prefill_replica  # the engine that took the request
            if not killed and tokens and serving:
                killed = serving
                os.kill(engine_core_pid(replica_actor(APP, "Engine", killed)), signal.SIGKILL)
        assert killed, "the stream ended before an engine was killed"
        assert last is not None and last.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == MAX_TOKENS
        assert tokens == list(reference.token_ids)
        # A new request goes to the live replica (the router avoids the one that failed).
        after = collect(client.generate("after the kill", max_tokens=4))
    assert after.timings.prefill_replica not in ("", killed), after.timings
    # The stream moved (its timings keep naming the replica it started on).
    assert wait_metric_at_least("pdserve_migrations_total", 1, app=APP) >= 1
