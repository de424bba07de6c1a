"""The KV crosses a host boundary: prefill in an actor on host b, decode on host c (network
namespaces with their own addresses and loopbacks, Ray nodes of one cluster), for each backend,
on the default model, against the monolithic engine and transformers; and the decode engine
loaded the prompt's KV rather than computing it."""

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
    finally:
        ray.kill(prefill)
        ray.kill(decode)
