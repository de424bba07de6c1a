"""Helpers for KV connector engine tests: several offline engines in one process, prompts,
sampling params and leak probes. No fixtures here; tests/engine/test_ray_connector.py has them.

vLLM keeps ONE worker-side KV connector per process (kv_transfer_state._KV_CONNECTOR_AGENT), so
`InprocEngine` keeps its engine's own connector and installs it only while that engine steps.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.settings import EngineSettings

PRODUCE = {"do_remote_decode": True}


class InprocEngine:
    """An offline engine in this process. Engines live for the whole module: vLLM's in-process
    teardown also tears down process-global state (its parallel groups) the others still use."""

    def __init__(self, settings: EngineSettings, kv_transfer: Any = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.distributed.kv_transfer import kv_transfer_state

        self._state = kv_transfer_state
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.llm = LLM(**settings.vllm_kwargs(kv_transfer))
        self._connector = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = None

    @contextmanager
    def active(self) -> Iterator[None]:
        self._state._KV_CONNECTOR_AGENT = self._connector
        try:
            yield
        finally:
            self._state._KV_CONNECTOR_AGENT = None

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        from vllm.inputs import TokensPrompt

        with self.active():
            return self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )

    def run(
        self, requests: dict[str, tuple[list[int], Any]], abort_at_step: dict[str, int]
    ) -> dict[str, Any]:
        """Step the engine by hand, aborting each request of `abort_at_step` after that many
        steps (0: before the first). Returns the finished outputs by request id."""
        from vllm.inputs import TokensPrompt

        engine, finished = self.llm.llm_engine, dict[str, Any]()
        with self.active():
            for request_id, (prompt, params) in requests.items():
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            step = 0
            while True:
                due = [r for r, s in abort_at_step.items() if s == step]
                if due:
                    engine.abort_request(due)
                if not engine.has_unfinished_requests():
                    return finished
                finished.update({o.request_id: o for o in engine.step() if o.finished})
                step += 1

    @property
    def scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def num_used_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())  # 1: vLLM's null block


def make_prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]  # 0-2 are the special tokens


def greedy(max_tokens: int, kv: dict[str, Any] | None = None, **extra: Any) -> Any:
    from vllm import SamplingParams

    extra_args = {"kv_transfer_params": kv} if kv is not None else None
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args, **extra
    )


def prefill(producer: InprocEngine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outputs = producer.generate(prompts, greedy(1, PRODUCE))
    return [out.kv_transfer_params for out in outputs]


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def wait_for_no_leases(registry: Any, timeout_s: float = 10.0) -> int:
    import ray

    deadline = time.monotonic() + timeout_s
    while (live := ray.get(registry.num_live.remote())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(live)


class KVUsageRecorder:
    """A vLLM stat logger that keeps the engine's latest KV cache usage (0.0: no used blocks)."""

    def __init__(self) -> None:
        self.usage: float | None = None

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any
            ) -> None:
                if scheduler_stats is not None:
                    recorder.usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return Logger(vllm_config, engine_index)


async def last_output(stream: Any) -> Any:
    last = None
    async for out in stream:
        last = out
    return last
