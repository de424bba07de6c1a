"""The KV crosses a Ray node boundary: prefill in an actor on node a, decode on node b (two
raylets and object stores on this machine), for each backend, against the monolithic engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from engine.local import LocalEngine
from engine.messages import GenerationRequest
from kv_transfer.base import TransferSettings
from tests.builders import make_greedy, make_settings, prompt_of_length


class PrefillActor:
    def __init__(self, model: Path, transfer: TransferSettings) -> None:
        from prefill_workers.worker import PrefillWorker

        self.worker = PrefillWorker(make_settings(model, cpu_cores=(0,)), transfer)
        self.worker.start()

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def prefill(self, request: GenerationRequest) -> Any:
        return await self.worker.prefill(request)

    async def is_idle(self) -> bool:
        return await self.worker.is_idle()


class DecodeActor:
    def __init__(self, model: Path, transfer: TransferSettings) -> None:
        from decode_workers.worker import DecodeWorker

        self.worker = DecodeWorker(make_settings(model, cpu_cores=(1,)), transfer)
        self.worker.start()

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def decode(self, request: GenerationRequest, handoff: Any) -> list[int]:
        tokens: list[int] = []
        async for chunk in self.worker.decode(request, handoff):
            tokens.extend(chunk.token_ids)
        return tokens

    async def is_idle(self) -> bool:
        return await self.worker.is_idle()


@pytest.mark.parametrize("backend", ["nixl", "ray"])
def test_kv_crosses_ray_nodes(
    backend: str,
    ray_cluster: Any,
    transfer_settings: dict[str, TransferSettings],
    tiny_model: Path,
    tiny_engine: LocalEngine,
) -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    transfer = transfer_settings[backend]
    remote_prefill = ray.remote(PrefillActor).options(num_cpus=0, resources={"node_a": 0.1})
    remote_decode = ray.remote(DecodeActor).options(num_cpus=0, resources={"node_b": 0.1})
    prefill = remote_prefill.remote(tiny_model, transfer)
    decode = remote_decode.remote(tiny_model, transfer)
    try:
        assert ray.get(prefill.node_id.remote()) != ray.get(decode.node_id.remote())
        params = make_greedy(max_tokens=12, ignore_eos=True)
        for i, length in enumerate([1, 33, 700]):
            prompt = prompt_of_length(tiny_engine.tokenizer, length)
            request = GenerationRequest(f"xnode-{backend}-{i}", prompt, params)
            result = ray.get(prefill.prefill.remote(request), timeout=120)
            rest = ray.get(decode.decode.remote(request, result.handoff), timeout=120)
            want = tiny_engine.generate([list(prompt)], params)[0].token_ids
            assert [result.first_token, *rest] == want, length
        assert ray.get(prefill.is_idle.remote()) and ray.get(decode.is_idle.remote())
    finally:
        ray.kill(prefill)
        ray.kill(decode)
