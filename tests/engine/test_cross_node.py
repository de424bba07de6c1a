"""The KV crosses a host boundary: prefill in an actor on host b, decode on host c (network
namespaces with their own addresses and loopbacks, Ray nodes of one cluster), for each backend,
on the default model, against the monolithic engine and transformers; and the decode engine
loaded the prompt's KV rather than computing it. Then host b's link is cut before a read."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.local import LocalEngine
from engine.messages import GenerationRequest
from engine.reference import ReferenceModel
from engine.stats import KVLoadCounts
from kv_transfer.base import TransferSettings
from tests.builders import make_greedy, make_settings, prompt_of_length

pytestmark = pytest.mark.engine


def _on_this_node(transfer: TransferSettings) -> TransferSettings:
    """What a replica does (kv_transfer/endpoint.py): announce and join from its own host."""
    import ray

    return replace(transfer, node_ip=ray.util.get_node_ip_address())


class PrefillActor:
    def __init__(self, model: Path, transfer: TransferSettings) -> None:
        from prefill_workers.worker import PrefillWorker

        self.worker = PrefillWorker(make_settings(model, cpu_cores=(0,)), _on_this_node(transfer))
        self.worker.start()

    def node_ip(self) -> str:
        return self.worker.transfer.node_ip

    async def prefill(self, request: GenerationRequest) -> Any:
        return await self.worker.prefill(request)

    async def is_idle(self) -> bool:
        return await self.worker.is_idle()


class DecodeActor:
    def __init__(self, model: Path, transfer: TransferSettings) -> None:
        from decode_workers.worker import DecodeWorker

        self.worker = DecodeWorker(make_settings(model, cpu_cores=(1,)), _on_this_node(transfer))
        self.worker.start()

    def node_ip(self) -> str:
        return self.worker.transfer.node_ip

    async def decode(self, request: GenerationRequest, handoff: Any) -> list[int]:
        tokens: list[int] = []
        async for chunk in self.worker.decode(request, handoff):
            tokens.extend(chunk.token_ids)
        return tokens

    def kv_loads(self) -> KVLoadCounts:
        return self.worker.stats.kv_loads

    async def is_idle(self) -> bool:
        return await self.worker.is_idle()


@pytest.mark.parametrize("backend", ["nixl", "ray"])
def test_kv_crosses_hosts(
    backend: str,
    ray_cluster: Any,
    transfer_settings: dict[str, TransferSettings],
    default_model: Path,
    default_engine: LocalEngine,
    default_reference: ReferenceModel,
) -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    transfer = transfer_settings[backend]
    remote_prefill = ray.remote(PrefillActor).options(num_cpus=0, resources={"host_b": 0.1})
    remote_decode = ray.remote(DecodeActor).options(num_cpus=0, resources={"host_c": 0.1})
    prefill = remote_prefill.remote(default_model, transfer)
    decode = remote_decode.remote(default_model, transfer)
    try:
        hosts = ray_cluster.hosts
        assert ray.get(prefill.node_ip.remote()) == hosts.ip("b")
        assert ray.get(decode.node_ip.remote()) == hosts.ip("c")
        params = make_greedy(max_tokens=12, ignore_eos=True)
        lengths = [1, 33, 700]
        for i, length in enumerate(lengths):
            prompt = prompt_of_length(default_engine.tokenizer, length)
            request = GenerationRequest(f"xhost-{backend}-{i}", prompt, params)
            result = ray.get(prefill.prefill.remote(request), timeout=120)
            rest = ray.get(decode.decode.remote(request, result.handoff), timeout=120)
            got = [result.first_token, *rest]
            assert got == default_engine.generate([list(prompt)], params)[0].token_ids, length
            assert got == default_reference.generate(list(prompt), params), length
        # Every prompt's KV was loaded from host b: decode computed at most each last token.
        loads = ray.get(decode.kv_loads.remote())
        assert loads == KVLoadCounts(num_loads=len(lengths)), loads
        assert ray.get(prefill.is_idle.remote()) and ray.get(decode.is_idle.remote())
        _load_across_a_cut_link(transfer, hosts, prefill, decode, default_engine, params)
    finally:
        ray.kill(prefill)
        ray.kill(decode)


def _load_across_a_cut_link(
    transfer: TransferSettings,
    hosts: Any,
    prefill: Any,
    decode: Any,
    engine: LocalEngine,
    params: Any,
) -> None:
    """Host b's link is cut (`ip link set ... down`) after its prefill and before decode on
    host c reads the KV, and comes back after the transfer deadline: the read gives up at
    `transfer_timeout_s`, decode recomputes the prompt and answers the monolithic engine's
    tokens, and once the link is back both engines are idle (the producer's blocks were given
    back) and no lease is left. The cut stays well under Ray's node health timeout."""
    import time

    import ray

    from tests.conftest import TEST_TRANSFER_TIMEOUT_S

    backend = transfer.backend
    prompt = prompt_of_length(engine.tokenizer, 300)
    request = GenerationRequest(f"xhost-{backend}-cut", prompt, params)
    result = ray.get(prefill.prefill.remote(request), timeout=120)
    before = ray.get(decode.kv_loads.remote())
    hosts.set_link("b", up=False)
    try:
        started = time.monotonic()
        answer = decode.decode.remote(request, result.handoff)
        ready, _ = ray.wait([answer], timeout=TEST_TRANSFER_TIMEOUT_S + 20)
        elapsed = time.monotonic() - started
    finally:
        hosts.set_link("b", up=True)
    print(f"\n{backend}: decode across a cut link answered after {elapsed:.1f} s")
    assert ready, f"decode across a cut link did not answer within {elapsed:.0f} s"
    got = [result.first_token, *ray.get(answer)]
    assert got == engine.generate([list(prompt)], params)[0].token_ids
    assert TEST_TRANSFER_TIMEOUT_S <= elapsed < TEST_TRANSFER_TIMEOUT_S + 20
    loads = ray.get(decode.kv_loads.remote()).minus(before)
    assert (loads.num_loads, loads.num_failures) == (1, 1), loads
    deadline = time.monotonic() + 30
    while not (ray.get(prefill.is_idle.remote()) and ray.get(decode.is_idle.remote())):
        assert time.monotonic() < deadline, "KV blocks still held 30 s after the link came back"
        time.sleep(0.5)
    if backend == "ray":
        from kv_transfer.ray_lease import get_lease_registry

        registry = get_lease_registry(transfer.lease_registry, transfer.ray_namespace)
        assert ray.get(registry.num_live.remote(), timeout=30) == 0
