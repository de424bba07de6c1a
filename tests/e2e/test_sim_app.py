"""The Serve app with simulated engines (engine.sim: cpu-smollm2 profile): the real router,
pools, handoffs and streams, with engine steps timed by the profile, so every timing here is
predicted by the profile's numbers, and the tokens by the sim's pure token function."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.client import acollect, collect
from deploy.config import AppConfig, with_sim_engine
from engine.sim.profile import load_link, load_profile
from tests.e2e.conftest import APP_TIMEOUT_S, ServedApp, ServeProxy

PROFILE = load_profile("cpu-smollm2")
LINK = load_link(PROFILE.default_link)
START_DELAY_S = 1.5


def prefill_s(num_tokens: int) -> float:
    return PROFILE.step_seconds([(0, num_tokens)], [])


def sim_config(name: str, topology: str) -> AppConfig:
    base = AppConfig.model_validate(
        {
            "name": name,
            "topology": topology,
            "engine": {"model": "tiny", "kv_cache_memory_bytes": 64 * 1024**2},
            "router": {"default_max_tokens": 16},
            "autoscaling": {"enabled": False},
        }
    )
    return AppConfig.model_validate(
        with_sim_engine(base.model_dump(), PROFILE.name, start_delay_s=START_DELAY_S)
    )


@pytest.fixture(scope="module")
def sim_apps(serve_proxy: ServeProxy) -> Iterator[dict[str, ServedApp]]:
    from ray import serve
    from ray.serve import api as serve_api

    from deploy.app import build_app
    from deploy.up import wait_serving

    apps = {
        topology: ServedApp(
            topology,
            sim_config(f"sim-{topology}", topology),
            serve_proxy.grpc_target,
            serve_proxy.http_port,
        )
        for topology in ("disaggregated", "colocated")
    }
    for app in apps.values():
        serve_api._run(
            build_app(app.config), name=app.name, route_prefix=f"/{app.name}", _blocking=False
        )
    for app in apps.values():
        wait_serving(app.name, APP_TIMEOUT_S)
        # A first call opens the router's handles and channels; the tests time later ones.
        with app.client() as client:
            collect(client.generate("warm-up", max_tokens=2, ignore_eos=True))
    yield apps
    for app in apps.values():
        serve.delete(app.name)


PROMPT = "The prefill pool computes the prompt's KV cache, then hands it over. " * 12


def test_ttft_tpot_and_transfer_follow_the_profile(sim_apps: dict[str, ServedApp]) -> None:
    app = sim_apps["disaggregated"]
    with app.client() as client, app.expect_kv_loaded(1):
        chunks = list(client.generate(PROMPT, max_tokens=24, ignore_eos=True))
        done = collect(iter(chunks))
    n = done.usage.prompt_tokens
    assert n > 300 and done.usage.completion_tokens == 24 and len(done.token_ids) == 24
    assert done.finish_reason == "length"
    first, last = chunks[0].timings, done.timings
    expected_prefill = prefill_s(n)
    # The profile's times are floors; the ceilings leave room for a loaded machine (asyncio's
    # sleeps overshoot when the replica's process waits for a core).
    assert expected_prefill <= first.prefill_s < expected_prefill * 1.2 + 0.05
    assert expected_prefill <= first.ttft_s < expected_prefill + 1.0
    # Decode pool's first token: the bytes over the link, one step computing the last prompt
    # position (its token is prefill's, dropped), one decode step.
    transfer = LINK.transfer_seconds(n * PROFILE.kv_bytes_per_token)
    last_position = PROFILE.step_seconds([(n - 1, 1)], [])
    decode_step = PROFILE.step_seconds([], [n + 1])
    assert transfer + last_position + decode_step <= last.kv_transfer_s < 1.0
    # mean TPOT includes the gap from the first token to the decode pool's first (the hop).
    assert decode_step <= last.mean_tpot_s < decode_step * 2


def test_same_prompt_same_tokens_in_both_topologies_and_prefix_cache_hits(
    sim_apps: dict[str, ServedApp],
) -> None:
    disaggregated, colocated = sim_apps["disaggregated"], sim_apps["colocated"]
    prompt = "A prompt of its own, so no engine has seen its blocks yet. " * 10
    with disaggregated.client() as client:
        first = collect(client.generate(prompt, max_tokens=12, ignore_eos=True))
        second = collect(client.generate(prompt, max_tokens=12, ignore_eos=True))
    with colocated.client() as client:
        third = collect(client.generate(prompt, max_tokens=12, ignore_eos=True))
    assert first.token_ids == second.token_ids == third.token_ids
    assert first.text == second.text and first.text
    # The second prefill found the prompt's full blocks in the engine's prefix cache.
    assert second.timings.prefill_s < 0.25 * first.timings.prefill_s
    assert first.timings.prefill_s >= prefill_s(first.usage.prompt_tokens)


async def test_concurrent_streams_batch_on_the_decode_engine(
    sim_apps: dict[str, ServedApp],
) -> None:
    app = sim_apps["disaggregated"]
    prompts = [f"request {i}: " + "tokens for the sim " * 8 for i in range(6)]
    async with app.aclient() as client:
        done = await asyncio.gather(
            *(acollect(client.generate(p, max_tokens=32, ignore_eos=True)) for p in prompts)
        )
    assert [d.usage.completion_tokens for d in done] == [32] * 6
    assert len({d.token_ids for d in done}) == 6
    # Decode steps carry all six sequences: each is slower than a lone sequence's step.
    lone = PROFILE.step_seconds([], [100])
    batched = PROFILE.step_seconds([], [100] * 6)
    tpots = [d.timings.mean_tpot_s for d in done]
    assert lone * 1.1 < min(tpots) and max(tpots) < batched * 2, tpots
    idle = await app.wait_engines_idle()
    assert all(idle.values()), idle


def test_sim_replicas_load_neither_vllm_nor_torch(sim_apps: dict[str, ServedApp]) -> None:
    """A sim replica's process, after serving: no vLLM module imported and no libtorch mapped
    (its requests' sampling params are the sim engine's own, engine/sampling.py), so a sim
    replica costs tens of MiB, not vLLM's ~0.5 GB."""
    import ray

    for app in sim_apps.values():
        for deployment in app.engine_deployments:
            prefix = f"SERVE_REPLICA::{app.name}#{deployment}#"
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(prefix)
            ]
            assert names, prefix
            for name in names:
                actor = ray.get_actor(name, namespace="serve")
                imported, pid = ray.get(
                    actor.__ray_call__.remote(
                        lambda _: (
                            sorted(m for m in __import__("sys").modules if m.startswith("vllm")),
                            __import__("os").getpid(),
                        )
                    ),
                    timeout=30,
                )
                assert imported == [], (name, imported[:5])
                maps = Path(f"/proc/{pid}/maps").read_text()
                assert "libtorch" not in maps, name
