"""The Serve app with simulated engines (engine.sim: cpu-smollm2 profile): the real router,
pools, handoffs and streams, with engine steps timed by the profile, so every timing here is
predicted by the profile's numbers, and the tokens by the sim's pure token function."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from api.client import acollect, collect
from control.redis_server import RedisServer
from deploy.config import AppConfig, with_sim_engine
from engine.sim.profile import load_link, load_profile
from tests.e2e.conftest import (
    APP_TIMEOUT_S,
    ServedApp,
    ServeProxy,
    deployed,
    replica_states,
    wait_for,
)

PROFILE = load_profile("cpu-smollm2")
LINK = load_link(PROFILE.default_link)
START_DELAY_S = 1.5
# The profile's times are floors but for this: steps run back to back on the profile's clock
# (engine/sim/engine.py), so a request scheduled a moment after the engine woke ends that much
# early (0.2 ms seen in a clean-clone run).
FLOOR_SLACK_S = 0.005


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
    assert expected_prefill - FLOOR_SLACK_S <= first.prefill_s < expected_prefill * 1.2 + 0.05
    assert expected_prefill - FLOOR_SLACK_S <= first.ttft_s < expected_prefill + 1.0
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
    # The second prefill found the prompt's full blocks in the engine's prefix cache: it took
    # less than the profile's floor for the whole prompt, which a miss never does (on a loaded
    # machine a step overshoots its time, so no tighter bound holds).
    whole = prefill_s(first.usage.prompt_tokens) - FLOOR_SLACK_S
    assert first.timings.prefill_s >= whole
    assert second.timings.prefill_s < whole, (second.timings.prefill_s, whole)


def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages(
    sim_apps: dict[str, ServedApp], serve_proxy: ServeProxy
) -> None:
    """`engine.stream_interval: 4` (engine/intervals.py): prefill's first token and decode's
    first go at once, then four tokens a message, the rest at the finish."""
    data = sim_config("sim-interval", "disaggregated").model_dump()
    data["engine"]["stream_interval"] = 4
    prompt = "Several tokens to a message, when a stream interval asks for them. " * 4

    def messages(app: ServedApp) -> list[tuple[int, ...]]:
        with app.client() as client:
            stream = client.generate(prompt, max_tokens=16, ignore_eos=True)
            return [tuple(chunk.token_ids) for chunk in stream if chunk.token_ids]

    one_each = messages(sim_apps["disaggregated"])
    with deployed("interval", AppConfig.model_validate(data), serve_proxy) as app:
        grouped = messages(app)
    assert [len(m) for m in one_each] == [1] * 16
    assert [len(m) for m in grouped] == [1, 1, 4, 4, 4, 2]
    assert sum(grouped, ()) == sum(one_each, ())


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


def test_topology_auto_deploys_what_the_plan_picks(serve_proxy: ServeProxy, tmp_path: Path) -> None:
    """`topology: auto` is planned when Serve builds the app (deploy/plan.py): chat at a 0.3 s
    TPOT on the CPU profile is served best by colocated x2 (1.29x the 1:1 split, predicted),
    so where the config's pools say 1 prefill and 1 decode replica, Serve runs one Engine
    deployment of 2 replicas, and it answers."""
    from ray import serve

    workload = tmp_path / "chat-loose.yaml"
    workload.write_text(
        "name: chat-loose\n"
        "prompt_tokens: {kind: uniform, low: 64, high: 192}\n"
        "output_tokens: {kind: uniform, low: 32, high: 96}\n"
        "num_requests: 1\nrates: [1.0]\nslo: {ttft_s: 2.0, tpot_s: 0.3}\n"
    )
    data = sim_config("sim-auto", "auto").model_dump()
    data["plan"] = {"workload": str(workload)}
    config = AppConfig.model_validate(data)
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (1, 1)
    with deployed("auto", config, serve_proxy) as app:
        assert set(serve.status().applications[app.name].deployments) == {"Router", "Engine"}
        assert replica_states(app.name, "Engine") == {"RUNNING": 2}
        with app.client() as client:
            done = collect(client.generate("Plan me.", max_tokens=4, ignore_eos=True))
        assert done.usage.completion_tokens == 4 and len(done.token_ids) == 4
        assert done.timings.kv_transfer_s == 0.0  # colocated: nothing crossed


@pytest.fixture(scope="module")
def adaptive_app(serve_proxy: ServeProxy) -> Iterator[ServedApp]:
    """A disaggregated sim app whose router decides where each prompt is prefilled
    (`router.adaptive_prefill`), keeping decode streams within a 0.2 s TPOT."""
    data = sim_config("sim-adaptive", "disaggregated").model_dump()
    data["router"]["adaptive_prefill"] = True
    data["engine"]["kv_cache_memory_bytes"] = 256 * 1024**2  # a 1,500-token prompt beside 4 streams
    data["autoscaling"]["tpot_p95_s"] = 0.2
    with deployed("adaptive", AppConfig.model_validate(data), serve_proxy) as app:
        yield app


# 185, 385 and 580 tokens.
LEARNING_PROMPTS = (PROMPT[:400], PROMPT, (PROMPT * 2)[:1250])


def prefilled_on(done: Any) -> str:
    """Which pool computed the prompt: "decode" (locally) or "prefill"."""
    return str(done.timings.prefill_replica).split("-", 1)[0]


def test_adaptive_prefill_learns_then_picks_the_path_per_request(adaptive_app: ServedApp) -> None:
    """With no transfer rate fitted, one request in 4 goes to the prefill pool to measure it
    and the rest stay local; then on an idle system every prompt stays local (a transfer only
    adds time). With 4 long streams decoding, a 1,500-token prompt (3.2 s of compute on the
    profile) would stall them past what their 0.2 s TPOT allows over a 12-token answer (about
    1.5 s of headroom at most), so it goes to the prefill pool, while a 100-token one (0.2 s)
    still fits and stays local. Every decision is counted.

    The learning prompts span 185 to 580 tokens: the prefill rate is fitted across them, not
    from prompts of one length and the 4-token probe, whose prefill shares a step with the 4
    streams (a line through those two undershot the big prompt's stall by a third, to about
    the headroom, and CI saw it stay local)."""
    import threading

    from tests.e2e.metrics import wait_metric

    app = adaptive_app
    with app.client() as client:
        paths = []
        for i in range(12):
            prompt = f"{i} " + LEARNING_PROMPTS[i % len(LEARNING_PROMPTS)]
            done = collect(client.generate(prompt, max_tokens=12, ignore_eos=True))
            paths.append(prefilled_on(done))
    assert paths == ["prefill", "decode", "decode", "decode"] * 2 + ["prefill"] + ["decode"] * 3

    # The next decision sees the decode replica's load as last reported: it can hold the last
    # learning prompt still queued (582 tokens, 1.1 s at the fitted rate, 0.9 s before, seen
    # once), and the queue is taken as worked off only as the report ages.
    time.sleep(2.5)
    stop = threading.Event()
    started = [threading.Event() for _ in range(4)]

    def long_stream(i: int) -> None:
        with app.client() as client:
            for _ in client.generate(f"long {i}", max_tokens=400, ignore_eos=True):
                started[i].set()
                if stop.is_set():
                    return

    streams = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(4)]
    try:
        # One after another, so no stream's prompt is in a queue when the next is placed.
        for thread, first_token in zip(streams, started, strict=True):
            thread.start()
            assert first_token.wait(30)
        time.sleep(2.0)
        with app.client() as client:
            # A short request first: its routing call shows the router the 4 running streams.
            assert prefilled_on(collect(client.generate("probe", max_tokens=2))) == "decode"
            done = collect(client.generate(PROMPT * 4, max_tokens=2, ignore_eos=True))
            assert done.usage.prompt_tokens > 1500
            assert prefilled_on(done) == "prefill"
            # Not a prefix of the long one (its blocks on the prefill replica would favour it).
            medium_prompt = "A medium prompt that no replica has seen. " * 4
            medium = collect(client.generate(medium_prompt, max_tokens=2, ignore_eos=True))
            assert 50 < medium.usage.prompt_tokens < 200
            assert prefilled_on(medium) == "decode"
    finally:
        stop.set()
        for thread in streams:
            thread.join(timeout=60)
    name = "pdserve_pd_decisions_total"
    assert wait_metric(name, 4, app=app.config.name, path="remote") == 4
    # Local: 9 while learning, the 4 long streams' short prompts, the probe and the medium one.
    assert wait_metric(name, 15, app=app.config.name, path="local") == 15


TPOT_APP = "sim-tpot"


@pytest.fixture(scope="module")
def tpot_app(serve_proxy: ServeProxy, redis_server: RedisServer) -> Iterator[ServedApp]:
    """A sim app whose pools autoscale (1 to 2 replicas each) against a TPOT target below the
    profile's decode step (59 ms for one stream): any decoding breaches it; TTFT's is loose."""
    config = autoscaled_sim_config(TPOT_APP, redis_server, ttft_p95_s=60.0, tpot_p95_s=0.05)
    with deployed("tpot", config, serve_proxy) as app:
        yield app


def autoscaled_sim_config(
    name: str,
    redis_server: RedisServer,
    replicas: tuple[int, int] = (1, 1),
    min_replicas: int = 1,
    router: dict[str, Any] | None = None,
    **autoscaling: float | bool,
) -> AppConfig:
    """A disaggregated sim app whose pools autoscale between `min_replicas` and 2 replicas
    (starting at `replicas`, prefill and decode) on a 1 s tick and a 5 s window, with the SLO
    and other knobs given (and `router` settings over the sim app's)."""
    data = sim_config(name, "disaggregated").model_dump()
    data["router"] |= router or {}
    for pool, num_replicas in zip(("prefill", "decode"), replicas, strict=True):
        data[pool] |= {
            "num_replicas": num_replicas,
            "min_replicas": min_replicas,
            "max_replicas": 2,
        }
    data["control"] = {"redis_url": redis_server.url}
    data["autoscaling"] |= {
        "enabled": True,
        "tick_s": 1.0,
        "window_s": 5.0,
        "upscale_cooldown_s": 5.0,
        **autoscaling,
    }
    return AppConfig.model_validate(data)


@contextmanager
def clients_back_to_back(
    app: ServedApp, num_clients: int, call: Callable[[Any, int, int], object]
) -> Iterator[None]:
    """`num_clients` threads, each with a client of its own, calling `call(client, i, n)` for
    n = 0, 1, ... until the block ends. Any call's error fails the block."""
    import itertools
    import threading

    stop = threading.Event()
    errors: list[BaseException] = []

    def calls(i: int) -> None:
        try:
            with app.client() as client:
                for n in itertools.count():
                    if stop.is_set():
                        break
                    call(client, i, n)
        except BaseException as exc:
            errors.append(exc)

    load = [threading.Thread(target=calls, args=(i,), daemon=True) for i in range(num_clients)]
    for thread in load:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in load:
            thread.join(timeout=60)
    assert not errors, errors[:1]


@contextmanager
def decode_heavy_streams(app: ServedApp, label: str) -> Iterator[set[str]]:
    """6 streams of 80 tokens after a few-token prompt each, back to back, until the block
    ends; yields the decode replicas that served them (as they finish). Any stream's error
    fails the block."""
    decoded_on: set[str] = set()

    def stream(client: Any, i: int, n: int) -> None:
        done = collect(client.generate(f"{label} {i}", max_tokens=80, ignore_eos=True))
        decoded_on.add(done.timings.decode_replica)

    with clients_back_to_back(app, 6, stream):
        yield decoded_on


def _running(deployment: str, app: str = TPOT_APP) -> int:
    return replica_states(app, deployment).get("RUNNING", 0)


def test_the_decode_pool_scales_on_tpot_live(
    tpot_app: ServedApp, redis_server: RedisServer
) -> None:
    """A decode-heavy burst (6 streams of 80 tokens, back to back) on the live Serve app: the
    decode pool's TPOT P95 passes its target, the decode policy scales 1 -> 2 and says why,
    and the prefill pool, within its TTFT target, stays at 1."""
    from control.sync_store import SyncControlStore

    assert (_running("Prefill"), _running("Decode")) == (1, 1)
    with decode_heavy_streams(tpot_app, "decode-heavy"):
        wait_for("decode to scale to 2", lambda: _running("Decode") >= 2, timeout_s=120)
    assert _running("Prefill") == 1
    with SyncControlStore.connect(redis_server.url, TPOT_APP) as store:
        ups = [d for d in store.recent_decisions(50, pool="decode") if d.target_replicas == 2]
        prefill = store.recent_decisions(50, pool="prefill")
    assert ups and "TPOT P95" in ups[-1].reason, ups
    assert ups[-1].inputs["tpot_p95_s"] > 0.05, ups[-1].inputs
    assert all(d.target_replicas == 1 for d in prefill), prefill


FLIP_APP = "sim-flip"


@pytest.fixture(scope="module")
def flip_app(serve_proxy: ServeProxy, redis_server: RedisServer) -> Iterator[ServedApp]:
    """A sim app whose prefill pool (1, at most 2) breaches its TTFT target on any request
    (1 ms), beside a decode pool of 2 idle replicas (at least 1) whose TPOT target is loose, so
    it is calm, with a down delay longer than the test."""
    config = autoscaled_sim_config(
        FLIP_APP,
        redis_server,
        replicas=(1, 2),
        ttft_p95_s=0.001,
        tpot_p95_s=10.0,
        downscale_delay_s=600.0,
        split_follows_work=False,  # this test is about the flip that replaces a scale-up
    )
    with deployed("flip", config, serve_proxy) as app:
        yield app


def test_a_pool_that_must_grow_borrows_a_calm_replica_before_starting_one(
    flip_app: ServedApp, redis_server: RedisServer
) -> None:
    """Issue 16 item 3, live: the prefill pool's TTFT breaches, the decode pool is calm, so the
    prefill policy's first scale-up is a role flip (a decode replica takes prefill calls)
    instead of a replica start, and requests are then prefilled on that replica; the decode
    pool holds its 2 replicas (the lent one is its spare), and no prefill replica starts while
    the flip does."""
    from control.sync_store import SyncControlStore

    def flipped() -> dict[str, str]:
        with SyncControlStore.connect(redis_server.url, FLIP_APP) as store:
            return dict(store.role_table().flipped)

    def running(deployment: str) -> int:
        return _running(deployment, FLIP_APP)

    def decode_is_calm() -> bool:
        with SyncControlStore.connect(redis_server.url, FLIP_APP) as store:
            last = store.last_decision("decode")
        return last is not None and last.reason.startswith("hold: calm")

    assert (running("Prefill"), running("Decode")) == (1, 2)
    # A pool lends only once its policy says it is calm (its replicas all up and reporting).
    wait_for("the decode pool to be calm", decode_is_calm, timeout_s=60)
    prefilled_on: set[str] = set()
    with flip_app.client() as client:
        deadline = time.monotonic() + 120
        while not flipped():
            if time.monotonic() > deadline:
                with SyncControlStore.connect(redis_server.url, FLIP_APP) as store:
                    log = [(d.pool, d.reason) for d in store.recent_decisions(30)]
                pytest.fail(f"no flip within 120 s; decisions: {log}")
            collect(client.generate("a prompt to prefill", max_tokens=2, ignore_eos=True))
        ((borrowed, role),) = flipped().items()
        assert borrowed.startswith("decode-") and role == "prefill"
        assert running("Prefill") == 1  # the flip was the scale-up: nothing started
        for i in range(12):
            done = collect(client.generate(f"after the flip {i}", max_tokens=2, ignore_eos=True))
            prefilled_on.add(done.timings.prefill_replica)
    assert borrowed in prefilled_on, prefilled_on
    with SyncControlStore.connect(redis_server.url, FLIP_APP) as store:
        prefill = store.recent_decisions(100, pool="prefill")
        decode = store.recent_decisions(100, pool="decode")
    borrows = [d for d in prefill if d.reason.startswith(f"borrows {borrowed} from decode")]
    assert borrows and borrows[-1].target_replicas == borrows[-1].current_replicas == 1, prefill
    # The first scale decision of the prefill pool was the flip, not a start.
    firsts = [d for d in reversed(prefill) if d.reason.startswith(("borrows", "up:"))]
    assert firsts[0].reason.startswith("borrows"), firsts
    assert all(d.target_replicas == 2 for d in decode), decode
    assert running("Decode") == 2


SPLIT_APP = "sim-split"


@pytest.fixture(scope="module")
def split_app(serve_proxy: ServeProxy, redis_server: RedisServer) -> Iterator[ServedApp]:
    """A sim app of 2 prefill and 2 decode replicas, each pool held at 2 (so no pool starts or
    stops one), whose TPOT target (50 ms) is below the profile's decode step (59 ms): decoding
    is over a whole replica's worth of work per engine. Its router decides each prompt's path
    (adaptive prefill) and its split may lend every prefill engine to decoding."""
    config = autoscaled_sim_config(
        SPLIT_APP,
        redis_server,
        replicas=(2, 2),
        min_replicas=2,
        router={"adaptive_prefill": True},
        ttft_p95_s=60.0,
        tpot_p95_s=0.05,
        split_min_prefill_engines=0,
    )
    with deployed("split", config, serve_proxy) as app:
        yield app


def test_the_split_follows_the_work_live(split_app: ServedApp, redis_server: RedisServer) -> None:
    """Issue 16 item 3, live, to no prefill engine and back:
    - under decode-heavy load (6 streams of 80 tokens after 4-token prompts) the prefill
      share is near 0: the decode policy moves one prefill engine to decode calls by the
      share (2:2 -> 1:3); then, as no prompt would add 25 ms to a gap computed locally (one
      step computes a 4-token prompt beside the streams), the last (1:3 -> 0:4);
    - at 0:4 every prompt is computed on its decode engine, and those engines decode;
    - long prompts (407 tokens, 0.7 s each computed locally) then add far more than the
      50 ms TPOT SLO to a gap: the prefill policy takes one of its engines back (0:4 -> 1:3).
    No replica starts or stops throughout."""
    import re

    from control.sync_store import SyncControlStore

    def flipped() -> dict[str, str]:
        with SyncControlStore.connect(redis_server.url, SPLIT_APP) as store:
            return dict(store.role_table().flipped)

    def decisions(pool: str) -> list[Any]:
        with SyncControlStore.connect(redis_server.url, SPLIT_APP) as store:
            return store.recent_decisions(200, pool=pool)

    def routers_applied() -> bool:
        with SyncControlStore.connect(redis_server.url, SPLIT_APP) as store:
            version, applied = store.role_table().version, store.roles_applied()
        return bool(applied) and all(a.version >= version for a in applied.values())

    assert (_running("Prefill", SPLIT_APP), _running("Decode", SPLIT_APP)) == (2, 2)
    with decode_heavy_streams(split_app, "split") as decoded_on:
        wait_for("a flip of the split", lambda: bool(flipped()), timeout_s=120)
        (first,) = flipped()
        assert first.startswith("prefill-") and flipped()[first] == "decode"
        wait_for("no engine serving prefill", lambda: len(flipped()) == 2, timeout_s=60)
        assert set(flipped().values()) == {"decode"}
        # The router routes by the roles it last read (within its 0.1 s poll): wait for its ack.
        wait_for("the router to route by those roles", routers_applied, timeout_s=10)
        decoded_on.clear()
        with split_app.client() as client:
            alone = [collect(client.generate(f"alone {i}", max_tokens=4)) for i in range(6)]
        # Both prefill engines decode (streams of 80 tokens take about 5 s).
        wait_for("both lent engines to decode", lambda: set(flipped()) <= decoded_on, 30)
    # With no engine serving prefill each prompt was computed on its decode engine, no KV
    # moved.
    assert all(d.timings.prefill_replica == d.timings.decode_replica for d in alone), [
        d.timings for d in alone
    ]
    assert all(d.timings.kv_transfer_s == 0 for d in alone)
    decode = decisions("decode")
    splits = [d for d in decode if d.reason.startswith("split:")]
    assert len(splits) == 2, decode
    share, last = reversed(splits)
    assert share.reason.startswith("split: prefill share"), share
    assert share.inputs["work_decode"] > 1.0 and share.inputs["work_prefill"] < 0.1, share
    assert "within 50 ms (40 ms for the local ones): every prompt local: borrows" in last.reason

    def long_prompt(client: Any, i: int, n: int) -> None:
        # Its own first token: no block of it is a prefix-cache hit.
        prompt = f"long {i} {n}: " + "hello " * 100  # 407 tokens
        collect(client.generate(prompt, max_tokens=2, ignore_eos=True))

    with clients_back_to_back(split_app, 4, long_prompt):
        wait_for("a prefill engine back", lambda: len(flipped()) == 1, timeout_s=60)
    (still_lent,) = flipped()
    assert flipped()[still_lent] == "decode"
    backs = [d for d in decisions("prefill") if "no engine serves prefill" in d.reason]
    assert len(backs) == 1 and "recalls prefill-" in backs[0].reason, backs
    # What a local 407-token prompt added to a gap: most of its 0.7 s compute.
    added = re.search(r"local prompts add ([0-9]+) ms to a gap, past 50 ms", backs[0].reason)
    assert added is not None and int(added.group(1)) > 300, backs[0].reason
    assert all(d.target_replicas == 2 for d in decisions("decode") + decisions("prefill"))
    assert (_running("Prefill", SPLIT_APP), _running("Decode", SPLIT_APP)) == (2, 2)
    print(f"split decisions: {share.reason!r}; {last.reason!r}; {backs[0].reason!r}")
