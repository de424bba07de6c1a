"""Ownership of KV across the pools: cancellations leak nothing, mismatches are refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest

from decode_workers.worker import DecodeWorker
from engine.local import LocalEngine
from engine.messages import GenerationRequest, KVHandshakeError, KVTransferError
from engine.sampling import to_sampling_params
from engine.stats import KVLoadCounts
from prefill_workers.worker import PrefillWorker
from router.lifecycle import generate_disaggregated
from tests.builders import make_greedy, make_settings
from tests.engine.conftest import RAY_TINY, TINY_PAIRS
from tests.pd import make_request, run_pd, wait_idle

pytestmark = pytest.mark.engine

Pair = tuple[PrefillWorker, DecodeWorker]


async def live_leases(prefill: PrefillWorker, timeout: float = 10.0) -> int:
    """Leases the transfer layer still holds: the `ray` registry's objects; for `nixl` the
    producer's held blocks, which wait_idle already covers."""
    if prefill.backend.name != "ray":
        return 0
    from kv_transfer.ray_lease import get_lease_registry

    registry = get_lease_registry(prefill.transfer.lease_registry, prefill.transfer.ray_namespace)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        live = int(await registry.num_live.remote())
        if live == 0 or asyncio.get_running_loop().time() > deadline:
            return live
        await asyncio.sleep(0.2)


async def _consume(pair: Pair, request: GenerationRequest, stop_after: int | None) -> int:
    """Stream a request; with `stop_after`, walk away after that many events (a client that
    disconnects). Returns the number of events seen."""
    seen = 0
    stream = generate_disaggregated(pair[0], pair[1], request)
    try:
        async for _ in stream:
            seen += 1
            if stop_after is not None and seen >= stop_after:
                break
    finally:
        await stream.aclose()
    return seen


async def _cancel_after(coro: object, delay: float) -> None:
    task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
    await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@TINY_PAIRS
async def test_fifty_requests_with_cancellations_leak_nothing(
    pd_case: tuple[str, str, Pair],
) -> None:
    _, _, pair = pd_case
    loads_before = pair[1].stats.kv_loads
    rng = random.Random(0)
    jobs = []
    for i in range(50):
        prompt = tuple(rng.randrange(3, 200) for _ in range(rng.randrange(1, 300)))
        request = make_request(prompt, make_greedy(max_tokens=16, ignore_eos=True))
        kind = i % 5
        if kind == 0:  # gone right after the first token: the handoff was never decoded
            jobs.append(_consume(pair, request, stop_after=1))
        elif kind == 1:  # gone mid-decode
            jobs.append(_consume(pair, request, stop_after=3))
        elif kind == 2:  # task cancelled at a random moment: prefill, transfer or decode
            jobs.append(_cancel_after(_consume(pair, request, None), rng.uniform(0.0, 0.4)))
        else:
            jobs.append(_consume(pair, request, None))
    for start in range(0, 50, 10):
        await asyncio.gather(*jobs[start : start + 10])
    assert await wait_idle(*pair, timeout=60), "KV blocks still held after all requests ended"
    assert await live_leases(pair[0]) == 0, await live_lease_keys(pair[0])
    # Cancellations cut loads short, but none failed: decode never computed a prompt itself.
    loads = pair[1].stats.kv_loads.minus(loads_before)
    assert loads.num_loads > 0 and loads.num_failures == loads.num_recomputed_tokens == 0, loads
    # And the pair still serves correctly afterwards.
    tokens = await run_pd(*pair, make_request((5, 6, 7), make_greedy(max_tokens=4)))
    assert len(tokens) == 4


@RAY_TINY
async def test_a_store_whose_output_was_lost_is_released_by_its_owner(
    pd_case: tuple[str, str, Pair],
) -> None:
    """The race a cancelled prefill can lose: the engine finishes the prompt and registers its
    lease just as the abort arrives, and vLLM drops the output, the only copy of the key. Here
    without the timing: the engine runs the prefill directly and its output is thrown away."""
    _, _, pair = pd_case
    prefill = pair[0]
    attempt = "lost-output:1"
    sampling = to_sampling_params(
        make_greedy(max_tokens=1),
        max_tokens=1,
        kv_transfer_params=prefill.backend.producer_request_params(prefill.worker_id, attempt),
    )
    async for _ in prefill.engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, sampling, "lost"):
        pass
    assert await live_leases(prefill, timeout=0) == 1
    await prefill.backend.release_abandoned(prefill.worker_id, attempt)
    assert await live_leases(prefill, timeout=0) == 0, await live_lease_keys(prefill)


async def test_finished_at_first_token_releases_the_lease(pd_case: tuple[str, str, Pair]) -> None:
    _, _, pair = pd_case
    loads_before = pair[1].stats.kv_loads
    for _ in range(3):
        tokens = await run_pd(*pair, make_request((9, 10, 11), make_greedy(max_tokens=1)))
        assert len(tokens) == 1
    assert await wait_idle(*pair, timeout=10)
    assert await live_leases(pair[0]) == 0
    assert pair[1].stats.kv_loads == loads_before  # decode was never asked to load


async def live_lease_keys(prefill: PrefillWorker) -> list[str]:
    from kv_transfer.ray_lease import get_lease_registry

    registry = get_lease_registry(prefill.transfer.lease_registry, prefill.transfer.ray_namespace)
    return list(await registry.live_keys.remote())


async def test_layout_mismatch_is_refused_before_transfer(
    pd_case: tuple[str, str, Pair], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _, model_name, (prefill, decode) = pd_case
    mono: LocalEngine = request.getfixturevalue(f"{model_name}_engine")
    params = make_greedy(max_tokens=8, ignore_eos=True)
    pd_request = make_request(tuple(range(3, 40)), params)
    result = await prefill.prefill(pd_request)
    decoded = False
    try:
        other_block = DecodeWorker(replace(decode.settings, block_size=64), decode.transfer)
        with pytest.raises(KVHandshakeError, match="block_size: producer 32 != consumer 64"):
            async for _ in other_block.decode(pd_request, result.handoff):
                pass
        if model_name == "tiny":
            from engine.tiny import build_tiny_model

            other_model = build_tiny_model(tmp_path / "tiny-other", seed=99)
            other_weights = DecodeWorker(make_settings(other_model), decode.transfer)
            with pytest.raises(KVHandshakeError, match="weights_digest"):
                other_weights.check_handoff(result.handoff)
        tampered = replace(result.handoff, num_prompt_tokens=result.handoff.num_prompt_tokens + 1)
        with pytest.raises(KVTransferError, match="digest"):
            decode.check_handoff(tampered)
        assert other_block.engine is None  # never started: refused before any transfer
        # The refusals moved and spent nothing: the compatible decode worker still loads the
        # whole prompt from the same handoff and continues it exactly.
        loads_before = decode.stats.kv_loads
        rest = [
            t async for event in decode.decode(pd_request, result.handoff) for t in event.token_ids
        ]
        decoded = True
        want = mono.generate([list(pd_request.prompt_token_ids)], params)[0].token_ids
        assert [result.first_token, *rest] == want
        assert decode.stats.kv_loads.minus(loads_before) == KVLoadCounts(num_loads=1)
    finally:
        if not decoded:
            await decode.release(result.handoff)
    assert await wait_idle(prefill, decode, timeout=10)


async def test_a_stopping_prefill_replica_waits_until_its_handoff_is_pulled(
    pd_case: tuple[str, str, Pair],
) -> None:
    """What a prefill replica's graceful shutdown waits on (ReplicaShell.__del__): its handoff's
    KV lives on in its process (nixl: the engine's blocks; ray: objects its engine put in Ray's
    store) until the decode side pulls it; the wait ends then, not before, and a wait nobody
    ends gives up at its bound."""
    backend, _, (prefill, decode) = pd_case
    request = make_request((21, 22, 23, 24, 25), make_greedy(max_tokens=4))
    result = await prefill.prefill(request)
    assert not await prefill.is_drained()
    if backend == "ray":
        assert await live_leases(prefill, timeout=0) == 1
    assert await prefill.wait_drained(0.5) is False  # a bound nobody meets ends the wait
    drain = asyncio.ensure_future(prefill.wait_drained(60))
    await asyncio.sleep(1.0)
    assert not drain.done()
    tokens = [t async for event in decode.decode(request, result.handoff) for t in event.token_ids]
    assert len(tokens) == 3  # after the prefill's first token
    assert await asyncio.wait_for(drain, 30) is True
    assert await wait_idle(prefill, decode, timeout=10)
    assert await live_leases(prefill) == 0


@RAY_TINY
async def test_the_lease_registry_comes_back_after_its_process_dies(
    pd_case: tuple[str, str, Pair],
) -> None:
    """The `ray` backend's lease registry is one actor: its process is killed, Ray starts it
    again under the same name and handles, and requests after that hand their KV over as
    before (the engines' connectors keep the handles they took at start)."""
    import ray

    from kv_transfer.ray_lease import get_lease_registry

    _, _, pair = pd_case
    prefill = pair[0]
    params = make_greedy(max_tokens=6, ignore_eos=True)
    # Prompts of two blocks and a bit, a new one each time (no prefix cache to hit).
    assert len(await run_pd(*pair, make_request(tuple(range(100, 170)), params))) == 6
    registry = get_lease_registry(prefill.transfer.lease_registry, prefill.transfer.ray_namespace)

    async def registry_pid() -> int:
        return int(await asyncio.wait_for(registry.__ray_call__.remote(lambda _: os.getpid()), 10))

    killed = await registry_pid()
    ray.kill(registry, no_restart=False)
    deadline = asyncio.get_running_loop().time() + 60
    # Until a new process answers: the kill is asynchronous, and the old one may still answer
    # a call or two (a lease registered there then dies with it, as CI saw once).
    while True:
        try:
            if await registry_pid() != killed:
                break
        except (TimeoutError, ray.exceptions.RayActorError):
            pass
        assert asyncio.get_running_loop().time() < deadline, "the registry did not return"
        await asyncio.sleep(0.5)
    assert await asyncio.wait_for(registry.num_live.remote(), 10) == 0
    before = pair[1].stats.kv_loads
    assert len(await run_pd(*pair, make_request(tuple(range(200, 270)), params))) == 6
    after = pair[1].stats.kv_loads
    assert after.num_loads == before.num_loads + 1
    assert after.num_failures == before.num_failures, (before, after)  # loaded, not recomputed
    assert await wait_idle(*pair, timeout=10)
    assert await live_leases(prefill) == 0


def engine_pids(worker: PrefillWorker) -> set[int]:
    """The processes of a served engine: its EngineCore and what runs under it (the worker
    that holds the KV and, for nixl, the NIXL agent)."""
    from tests.procs import descendants

    cores = worker.engine.engine_core.resources.engine_manager.processes
    return descendants(int(p.pid) for p in cores)


@TINY_PAIRS
async def test_a_load_from_a_producer_that_stopped_answering_gives_up_at_its_deadline(
    pd_case: tuple[str, str, Pair],
) -> None:
    """The prefill engine's processes are frozen (SIGSTOP) after its prefill and before decode
    pulls the KV. nixl: the read waits on the producer's NIXL agent; it gives up at the
    transfer deadline (`transfer_timeout_s`) instead of waiting for ever, decode recomputes
    the prompt, and once the producer wakes its KV is freed (the decode side gives the failed
    handoff back) without waiting for the lease. ray: the KV sits in the node's object store,
    and the load does not need the frozen process. Either way the stream is the uninterrupted
    run's."""
    import os
    import signal
    import time

    from tests.conftest import TEST_TRANSFER_TIMEOUT_S

    backend, _, (prefill, decode) = pd_case
    params = make_greedy(max_tokens=8, ignore_eos=True)
    # A first transfer, so the NIXL handshake is behind us; and the uninterrupted run's tokens.
    prompt = tuple((i * 7 + 3) % 400 + 50 for i in range(70))  # in the tiny model's vocabulary
    reference = await run_pd(prefill, decode, make_request(prompt, params))
    assert await wait_idle(prefill, decode, timeout=10)
    request = make_request(tuple((i * 11 + 5) % 400 + 50 for i in range(70)), params)
    expected = await run_pd(prefill, decode, replace(request, request_id="expected"))
    assert len(reference) == len(expected) == 8
    assert await wait_idle(prefill, decode, timeout=10)
    # Now the same request again, from a producer that goes silent after its prefill.
    result = await prefill.prefill(replace(request, request_id="frozen-producer"))
    before = decode.stats.kv_loads
    pids = engine_pids(prefill)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        tokens = [
            t
            async for event in decode.decode(
                replace(request, request_id="frozen-producer"), result.handoff
            )
            for t in event.token_ids
        ]
        elapsed = time.monotonic() - started
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    print(f"\nload from a frozen {backend} producer: decode finished after {elapsed:.1f} s")
    assert [result.first_token, *tokens] == expected
    loads = decode.stats.kv_loads.minus(before)
    if backend == "nixl":  # the read waits on the producer's NIXL agent, then gives up
        assert TEST_TRANSFER_TIMEOUT_S <= elapsed < TEST_TRANSFER_TIMEOUT_S + 15
        assert (loads.num_loads, loads.num_failures) == (1, 1), loads
        assert loads.num_recomputed_tokens > 32, loads  # the prompt's blocks, computed here
    else:  # ray: the KV is in the node's object store, which the frozen process does not serve
        assert elapsed < TEST_TRANSFER_TIMEOUT_S
        assert loads == KVLoadCounts(num_loads=1), loads
    # The producer's KV is freed now it answers again, well before its 60 s lease.
    assert await wait_idle(prefill, decode, timeout=15)
    assert await live_leases(prefill) == 0


@RAY_TINY
async def test_a_load_waiting_on_a_silent_registry_holds_up_no_other_request(
    pd_case: tuple[str, str, Pair],
) -> None:
    """The `ray` backend's lease registry is frozen (SIGSTOP) after a prefill: decode's load of
    that KV waits for it, up to the transfer deadline, but off the engine's thread, so a request
    that needs no transfer, sent to the same decode engine meanwhile, is answered at once (before
    the load ran on the engine thread and held every request up for the whole wait). The load
    then gives up and decode recomputes the prompt: the uninterrupted run's tokens."""
    import os
    import signal
    import time

    import ray

    from kv_transfer.ray_lease import get_lease_registry
    from tests.conftest import TEST_TRANSFER_TIMEOUT_S

    _, _, (prefill, decode) = pd_case
    params = make_greedy(max_tokens=8, ignore_eos=True)
    request = make_request(tuple((i * 13 + 7) % 400 + 50 for i in range(70)), params)
    expected = await run_pd(prefill, decode, replace(request, request_id="silent-expected"))
    assert await wait_idle(prefill, decode, timeout=10)
    result = await prefill.prefill(replace(request, request_id="silent-registry"))
    before = decode.stats.kv_loads
    transfer = prefill.transfer
    registry = get_lease_registry(transfer.lease_registry, transfer.ray_namespace)
    registry_pid = ray.get(registry.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    other = make_request(tuple((i * 3 + 1) % 400 + 50 for i in range(40)), params)

    async def decode_from_the_handoff() -> list[int]:
        events = decode.decode(replace(request, request_id="silent-registry"), result.handoff)
        return [t async for event in events for t in event.token_ids]

    os.kill(registry_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        waiting = asyncio.create_task(decode_from_the_handoff())
        await asyncio.sleep(1.0)  # the load has started and waits on the registry
        other_started = time.monotonic()
        answer = [t async for event in decode.generate(other) for t in event.token_ids]
        other_s = time.monotonic() - other_started
        tokens = await asyncio.wait_for(waiting, TEST_TRANSFER_TIMEOUT_S + 30)
        elapsed = time.monotonic() - started
    finally:
        os.kill(registry_pid, signal.SIGCONT)
    print(f"\nwhile a load waited {elapsed:.1f} s, a request without one took {other_s:.2f} s")
    assert len(answer) == 8
    assert other_s < TEST_TRANSFER_TIMEOUT_S / 2
    assert elapsed >= TEST_TRANSFER_TIMEOUT_S
    assert [result.first_token, *tokens] == expected
    loads = decode.stats.kv_loads.minus(before)
    assert (loads.num_loads, loads.num_failures) == (1, 1), loads
    assert await wait_idle(prefill, decode, timeout=15)
    assert await live_leases(prefill) == 0
