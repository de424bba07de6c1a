"""Builders for disaggregated tests: a started prefill/decode pair and a request runner."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from decode_workers.worker import DecodeWorker
from engine.messages import GenerationRequest
from engine.params import GenerationParams
from kv_transfer.base import TransferSettings
from prefill_workers.worker import PrefillWorker
from router.lifecycle import generate_disaggregated
from tests.builders import make_settings

_counter = 0


def make_request(prompt: tuple[int, ...], params: GenerationParams) -> GenerationRequest:
    global _counter
    _counter += 1
    return GenerationRequest(f"req-{_counter}", prompt, params)


def start_pair(
    model: Path, transfer: TransferSettings, **decode_overrides: object
) -> tuple[PrefillWorker, DecodeWorker]:
    prefill = PrefillWorker(make_settings(model, cpu_cores=(0,)), transfer)
    decode_settings = replace(make_settings(model, cpu_cores=(1,)), **decode_overrides)  # type: ignore[arg-type]
    decode = DecodeWorker(decode_settings, transfer)
    prefill.start()
    decode.start()
    return prefill, decode


async def run_pd(
    prefill: PrefillWorker, decode: DecodeWorker, request: GenerationRequest
) -> list[int]:
    tokens: list[int] = []
    async for event in generate_disaggregated(prefill, decode, request):
        tokens.extend(event.token_ids)
    return tokens


async def wait_idle(*workers: PrefillWorker | DecodeWorker, timeout: float = 30.0) -> bool:
    """True once every worker's engine holds no KV block (frees can lag a step or a lease)."""
    return all(await asyncio.gather(*(w.wait_idle(timeout) for w in workers)))
