"""The served app over real gRPC: token equality with the monolithic engine for both
topologies and both KV backends, streaming order, concurrency, health and model listing."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from api.client import acollect, collect
from api.gen.pdserve.v1 import pdserve_pb2
from engine.local import LocalEngine
from tests.builders import make_greedy
from tests.e2e.conftest import ServedApp, engine_core_pid, replica_actors
from tests.procs import cpu_seconds

pytestmark = pytest.mark.engine

APPS = ["nixl", "ray", "colocated"]
PROMPTS = ["hello world", "The prefill pool computes the prompt's KV cache.", "a b c d e f g " * 12]


def monolithic(engine: LocalEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    ids = [engine.encode(p) for p in prompts]
    return [
        list(c.token_ids) for c in engine.generate(ids, make_greedy(max_tokens, ignore_eos=True))
    ]


@pytest.mark.parametrize("key", APPS)
def test_stream_equals_monolithic_engine(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str
) -> None:
    app = serve_apps[key]
    expected = monolithic(tiny_engine, PROMPTS, 20)
    with app.client() as client, app.expect_kv_loaded(len(PROMPTS)):
        for prompt, want in zip(PROMPTS, expected, strict=True):
            done = collect(client.generate(prompt, max_tokens=20, ignore_eos=True))
            assert list(done.token_ids) == want, prompt
            assert done.finish_reason == "length"
            assert done.usage.completion_tokens == 20
            assert done.usage.prompt_tokens == len(tiny_engine.encode(prompt))


@pytest.mark.parametrize("key", APPS)
def test_complete_equals_generate(serve_apps: dict[str, ServedApp], key: str) -> None:
    with serve_apps[key].client() as client:
        streamed = collect(client.generate(PROMPTS[1], max_tokens=12))
        whole = client.complete(PROMPTS[1], max_tokens=12)
    assert list(whole.token_ids) == list(streamed.token_ids)
    assert whole.text == streamed.text
    assert whole.model == "tiny"
    assert whole.timings.e2e_s >= whole.timings.ttft_s > 0


@pytest.mark.parametrize("key", ["nixl", "ray"])
def test_first_token_is_streamed_before_decode_starts(
    serve_apps: dict[str, ServedApp], key: str
) -> None:
    app = serve_apps[key]
    with app.client() as client, app.expect_kv_loaded(1):
        chunks = list(client.generate(PROMPTS[2], max_tokens=8, ignore_eos=True))
    first, last = chunks[0], chunks[-1]
    assert len(first.token_ids) == 1
    # The first message left the router before the decode pool was called: it carries TTFT
    # and prefill time but no decode start yet; the last one has the decode start after TTFT.
    assert first.timings.ttft_s > 0 and first.timings.prefill_s > 0
    assert first.timings.decode_start_s == 0
    assert last.timings.decode_start_s >= first.timings.ttft_s
    # The transfer (decode call to its first token) lies between the decode start and the end.
    assert 0 < last.timings.decode_start_s + last.timings.kv_transfer_s <= last.timings.e2e_s
    assert last.timings.mean_tpot_s > 0


def test_32_concurrent_streams_are_all_correct(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine
) -> None:
    prompts = [f"request {i}: " + "token " * (i % 7 + 1) for i in range(32)]
    expected = monolithic(tiny_engine, prompts, 16)
    app = serve_apps["nixl"]

    async def run() -> list[list[int]]:
        async with app.aclient() as client:
            results = await asyncio.gather(
                *(acollect(client.generate(p, max_tokens=16, ignore_eos=True)) for p in prompts)
            )
        return [list(r.token_ids) for r in results]

    with app.expect_kv_loaded(len(prompts)):
        assert asyncio.run(run()) == expected


@pytest.mark.parametrize("key", APPS)
def test_seeded_sampling_equals_monolithic_engine(
    serve_apps: dict[str, ServedApp], tiny_engine: LocalEngine, key: str
) -> None:
    from engine.params import GenerationParams

    app = serve_apps[key]
    prompt = PROMPTS[1]
    sampled = []
    with app.client() as client, app.expect_kv_loaded(2):
        for seed in (7, 12345):
            done = collect(
                client.generate(prompt, max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
            )
            params = GenerationParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
            want = tiny_engine.generate([tiny_engine.encode(prompt)], params)[0].token_ids
            assert list(done.token_ids) == want, seed
            sampled.append(list(done.token_ids))
    assert sampled[0] != monolithic(tiny_engine, [prompt], 12)[0]  # it really sampled


def test_server_reflection_lists_the_services(serve_apps: dict[str, ServedApp]) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(serve_apps["nixl"].grpc_target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pdserve.v1.PDServeService", "grpc.health.v1.Health"} <= services


@pytest.mark.parametrize("key", APPS)
def test_health_and_models(serve_apps: dict[str, ServedApp], key: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    app = serve_apps[key]
    with app.client() as client:
        health = client.health()
        models = client.list_models()
    assert health.serving
    pools = [(pdserve_pb2.Pool.Name(p.pool), p.ready_replicas) for p in health.pools]
    assert pools == [(f"POOL_{name.upper()}", 1) for name in app.engine_deployments]
    assert [(m.id, m.max_model_len) for m in models.models] == [("tiny", 2048)]
    with grpc.insecure_channel(app.grpc_target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), metadata=(("application", app.name),)
        )
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_a_served_engine_core_naps_between_steps(serve_apps: dict[str, ServedApp]) -> None:
    """pdserve's vLLM plugin (engine/vllm_plugin.py) in a served engine's own processes: its
    EngineCore polls the worker's step results with naps, not vLLM's sched_yield loop, which
    kept it on a core through every step (72% of one during a chat stream, docs/benchmarks.md)
    and slowed the other core's engine by half. Timed over one long stream of the colocated
    app's engine."""
    (actor,) = replica_actors("colocated", "Engine").values()
    pid = engine_core_pid(actor)
    with serve_apps["colocated"].client() as client:
        collect(client.generate(PROMPTS[0], max_tokens=4))  # the engine is warm
        used, started = cpu_seconds(pid), time.monotonic()
        done = collect(client.generate(PROMPTS[2], max_tokens=1500, ignore_eos=True))
        wall = time.monotonic() - started
        used = cpu_seconds(pid) - used
    assert done.usage.completion_tokens == 1500
    assert used < 0.4 * wall, f"EngineCore used {used:.2f} CPU-s in {wall:.2f} s"
