"""Fitting a sim profile's step costs to the real engine on this machine (`pdserve sim
calibrate`): time prefills of several lengths and decodes at several batch sizes with the
offline vLLM engine, then fit engine/sim/profile.py's linear step model to them.

    decode:  (wall(max_tokens=1 + T) - wall(max_tokens=1)) / T  =  base + decode_seq x batch
    prefill: wall(n tokens, max_tokens=1)  =  call + prefill_token x n + attention x n^2 / 2

A prefill's wall time also holds the offline engine's per-call cost (request set-up, output
processing), which is no step's: its intercept (`call`) is fitted and left out of the profile.

`--served` times vLLM's AsyncLLM instead, its EngineCore in a child process as the replicas
run it (`ServedTimer`): every step then carries the process hop and the output handling a
served engine pays, which the offline engine does not (docs/sim.md, fidelity).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.sim.profile import StepCosts

PREFILL_LENGTHS = (128, 512, 1024, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_STEPS = 32
DECODE_PROMPT_TOKENS = 16


@dataclass(frozen=True)
class Measurements:
    """Seconds per prefill by prompt length, and per decode step by batch size."""

    prefill_s: dict[int, float]
    decode_step_s: dict[int, float]


def fit_step_costs(m: Measurements) -> StepCosts:
    batches = sorted(m.decode_step_s)
    slope, base = np.polyfit(batches, [m.decode_step_s[b] for b in batches], 1)
    base = max(0.0, float(base))
    lengths = sorted(m.prefill_s)
    design = np.array([[1, n, n * n / 2] for n in lengths], dtype=float)
    target = np.array([m.prefill_s[n] for n in lengths])
    (_call, per_token, attention), *_ = np.linalg.lstsq(design, target, rcond=None)
    return StepCosts(
        base_s=base,
        prefill_token_s=max(0.0, float(per_token)),
        prefill_attention_s=max(0.0, float(attention)),
        decode_seq_s=max(0.0, float(slope)),
    )


def measure(engine: Any, seed: int = 0) -> Measurements:
    """Time `engine` (an engine.local.LocalEngine); distinct random prompts, so nothing is
    served from the prefix cache."""
    from engine.params import GenerationParams

    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        engine.generate(batch, params)
        return time.perf_counter() - started

    timed(prompts(1, 32), 2)  # warm-up
    prefill = {n: timed(prompts(1, n), 1) for n in PREFILL_LENGTHS}
    decode = {}
    for batch in DECODE_BATCHES:
        short = timed(prompts(batch, DECODE_PROMPT_TOKENS), 1)
        long = timed(prompts(batch, DECODE_PROMPT_TOKENS), 1 + DECODE_STEPS)
        decode[batch] = max(0.0, long - short) / DECODE_STEPS
    return Measurements(prefill, decode)


class ServedTimer:
    """`measure`'s engine (a `tokenizer` and a blocking `generate(batch, params)`) over vLLM's
    AsyncLLM with its EngineCore in a child process, as a served replica runs it: one event
    loop of its own, the batch's requests sent together."""

    def __init__(self, settings: Any) -> None:
        from engine.async_engine import start_async_engine
        from engine.prompts import load_tokenizer

        self._loop = asyncio.new_event_loop()
        self.tokenizer = load_tokenizer(str(settings.model))

        async def start() -> Any:
            return start_async_engine(settings)[0]

        self.engine = self._loop.run_until_complete(start())

    def generate(self, batch: list[list[int]], params: Any) -> None:
        from engine.sampling import sampling_params_for

        async def one(ids: list[int]) -> None:
            sampling = sampling_params_for(self.engine, params, served=True)
            prompt = {"prompt_token_ids": ids}
            async for _ in self.engine.generate(prompt, sampling, f"cal-{uuid.uuid4().hex}"):
                pass

        async def all_of() -> None:
            await asyncio.gather(*(one(ids) for ids in batch))

        self._loop.run_until_complete(all_of())

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._loop.close()


def profile_json(
    name: str, costs: StepCosts, m: Measurements, kv: dict[str, int], description: str
) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "sources": [
            f"`pdserve sim calibrate` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
            f"prefill seconds by prompt length {m.prefill_s}, decode step seconds by batch "
            f"{m.decode_step_s}; fitted by engine/sim/calibrate.py"
        ],
        "kv": kv,
        "kv_cache_bytes": None,
        "max_num_batched_tokens": 2048,
        "default_link": "cpu-local",
        "step": {**vars(costs)},
    }
