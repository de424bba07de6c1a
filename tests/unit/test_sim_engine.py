"""SimAsyncLLM (engine/sim/engine.py): the AsyncLLM surface the workers use, timed by a profile."""

from __future__ import annotations

import asyncio
import enum
import time
from pathlib import Path
from typing import Any

import pytest

from engine.settings import EngineSettings
from engine.sim.engine import SimAsyncLLM
from engine.sim.profile import Link, load_profile, profile_from_dict
from engine.sim.tokens import TokenSource
from engine.stats import EngineStatsRecorder


class OutputKind(enum.Enum):  # vLLM's RequestOutputKind, by name
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


BASE_S = 0.02
PER_TOKEN_S = 0.0001


def make_engine(
    link: Link | None = None, budget: int = 512, recorder: EngineStatsRecorder | None = None
) -> SimAsyncLLM:
    profile = profile_from_dict(
        {
            "name": "test",
            "kv": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype_bytes": 2},
            "max_num_batched_tokens": budget,
            "step": {"base_s": BASE_S, "prefill_token_s": PER_TOKEN_S, "decode_seq_s": 0.0},
        }
    )
    settings = EngineSettings(model=Path("/unused"), kv_cache_memory_bytes=1 << 20)
    return SimAsyncLLM(
        settings, profile, link or Link("test", 1e9), TokenSource(range(1000, 1100)), recorder
    )


def sampling(max_tokens: int, kind: OutputKind, kv: dict[str, Any] | None = None) -> Any:
    return SimAsyncLLM.make_sampling_params(
        max_tokens=max_tokens,
        temperature=0.0,
        seed=None,
        output_kind=kind.name,
        extra_args={"kv_transfer_params": kv} if kv else None,
        top_p=1.0,  # a field a sim step does not read
    )


async def collect(engine: SimAsyncLLM, n_prompt: int, params: Any, rid: str) -> list[Any]:
    prompt = {"prompt_token_ids": list(range(n_prompt))}
    return [out async for out in engine.generate(prompt, params, rid)]


@pytest.mark.parametrize("kind", list(OutputKind))
async def test_outputs_follow_the_requested_output_kind(kind: OutputKind) -> None:
    engine = make_engine()
    outputs = await collect(engine, 10, sampling(5, kind), "r")
    engine.shutdown()
    tokens = outputs[-1].outputs[0].token_ids
    if kind is OutputKind.DELTA:
        assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)
        tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    elif kind is OutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    else:
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 6))
    assert len(tokens) == 5 and all(1000 <= t < 1100 for t in tokens)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_the_chunk_budget_comes_from_engine_kwargs_as_vllm_s_would() -> None:
    """An app's engine_kwargs.max_num_batched_tokens (what `topology: auto` sets for a chunk
    budget) is the sim scheduler's budget, over the field and the profile's."""
    profile = make_engine(budget=512).profile
    for field, kwargs, expected in (
        (None, {}, 512),
        (256, {}, 256),
        (256, {"max_num_batched_tokens": 64}, 64),
    ):
        settings = EngineSettings(
            model=Path("/unused"),
            kv_cache_memory_bytes=1 << 20,
            max_num_batched_tokens=field,
            engine_kwargs=kwargs,
        )
        engine = SimAsyncLLM(settings, profile, Link("test", 1e9), TokenSource(range(10)))
        assert engine.scheduler.max_num_batched_tokens == expected
        engine.shutdown()


async def test_first_token_and_steps_take_the_profiled_time() -> None:
    engine = make_engine()
    started = time.monotonic()
    outputs = await collect(engine, 300, sampling(4, OutputKind.DELTA), "r")
    elapsed = time.monotonic() - started
    engine.shutdown()
    metrics = outputs[0].metrics
    prefill_s = BASE_S + 300 * PER_TOKEN_S  # 50 ms
    assert prefill_s <= metrics.first_token_ts - metrics.queued_ts < prefill_s + 0.03
    assert prefill_s + 3 * BASE_S <= elapsed < prefill_s + 3 * BASE_S + 0.05
    assert engine.num_steps == 4


async def test_a_producer_hands_its_kv_size_to_a_consumer_that_waits_the_link() -> None:
    producer = make_engine()
    out = await collect(
        producer,
        64,
        sampling(1, OutputKind.DELTA, {"do_remote_decode": True, "sim_producer": "p1"}),
        "r",
    )
    kv = out[-1].kv_transfer_params["sim_kv"]
    assert kv == {"producer": "p1", "num_tokens": 64, "num_bytes": 64 * 32}
    recorder = EngineStatsRecorder()
    consumer = make_engine(Link("slow", bandwidth_bytes_per_s=64 * 32 / 0.1), recorder=recorder)
    params = sampling(3, OutputKind.DELTA, {"do_remote_prefill": True, "sim_kv": kv})
    started = time.monotonic()
    outputs = await collect(consumer, 64, params, "r")
    first_s = outputs[0].metrics.first_token_ts - started
    producer.shutdown()
    consumer.shutdown()
    assert outputs[0].outputs[0].token_ids[0] == out[-1].outputs[0].token_ids[0]
    assert outputs[0].num_cached_tokens == 63
    # 0.1 s on the link, then one step computing one position (not the 64-token prompt).
    assert 0.1 + BASE_S <= first_s < 0.1 + BASE_S + 0.03
    assert [s.num_bytes for s in recorder.take_transfers()] == [64 * 32]


async def test_closing_a_stream_aborts_the_request_and_frees_its_blocks() -> None:
    engine = make_engine()
    stream = engine.generate(
        {"prompt_token_ids": list(range(40))}, sampling(1000, OutputKind.DELTA), "r"
    )
    await anext(stream)
    assert engine.scheduler.blocks.num_used_blocks > 0
    await stream.aclose()
    assert engine.scheduler.blocks.num_used_blocks == 0
    assert await engine.reset_prefix_cache()
    engine.shutdown()


async def test_abort_ends_the_stream() -> None:
    engine = make_engine()

    async def read() -> list[Any]:
        return await collect(engine, 10, sampling(1000, OutputKind.DELTA), "r")

    task = asyncio.create_task(read())
    await asyncio.sleep(0.1)
    await engine.abort("r")
    outputs = await asyncio.wait_for(task, 1)
    engine.shutdown()
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert engine.scheduler.num_unfinished == 0


def test_shipped_profiles_load_and_time_a_step() -> None:
    for name in ("cpu-smollm2", "zero", "h100-llama2-7b", "h100x4-llama2-70b"):
        profile = load_profile(name)
        assert profile.kv_bytes_per_token > 0
    cpu = load_profile("cpu-smollm2")
    # FIELD-NOTES, fp32 one core: 0.95 s for a 512-token prefill, 16.8 tok/s at batch 1.
    assert cpu.step_seconds([(0, 512)], []) == pytest.approx(0.95, rel=0.02)
    assert 1 / cpu.step_seconds([], [100]) == pytest.approx(16.8, rel=0.02)
    with pytest.raises(ValueError, match="unknown sim profile"):
        load_profile("links")


def test_start_takes_the_configured_delay(tmp_path: Path) -> None:
    from engine.settings import SimSpec
    from engine.sim.engine import start_sim_engine

    (tmp_path / "tokenizer.json").write_text(
        '{"added_tokens": [{"id": 0}], "model": {"vocab": {"a": 0, "b": 1, "c": 2}}}'
    )
    settings = EngineSettings(model=tmp_path, sim=SimSpec("zero", start_delay_s=0.2))
    engine, seconds = start_sim_engine(settings)
    assert 0.2 <= seconds < 0.5
    assert engine.scheduler.tokens.token_ids == (1, 2)
    assert engine.link.name == "instant"
    with pytest.raises(ValueError, match="unknown sim link"):
        start_sim_engine(EngineSettings(model=tmp_path, sim=SimSpec("zero", "carrier-pigeon")))
