"""Shared builders for tests: settings and prompts, so no test copies them."""

from __future__ import annotations

from pathlib import Path

from deploy.workload import Workload
from engine.params import GenerationParams
from engine.platform import detect_device
from engine.settings import EngineSettings

KV_CACHE_BYTES_FOR_TESTS = 128 * 1024**2


def make_settings(model: Path, **overrides: object) -> EngineSettings:
    fields: dict[str, object] = {
        "model": model,
        # The installed engine build's device: the same tests run on a GPU machine.
        "device": detect_device(),
        "kv_cache_memory_bytes": KV_CACHE_BYTES_FOR_TESTS,
        "max_model_len": 2048,
    }
    fields.update(overrides)
    return EngineSettings(**fields)  # type: ignore[arg-type]


def make_greedy(max_tokens: int = 24, **overrides: object) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, **overrides)  # type: ignore[arg-type]


def long_text(num_words: int) -> str:
    words = ["prefill", "decode", "cache", "block", "token", "layer", "router", "replica"]
    return " ".join(f"{words[i % len(words)]}{i % 13}" for i in range(num_words))


def prompt_of_length(tokenizer: object, num_tokens: int) -> tuple[int, ...]:
    """Exactly `num_tokens` ids of ordinary text (never special tokens)."""
    ids: list[int] = []
    words = 8
    while len(ids) < num_tokens:
        ids = list(tokenizer(long_text(words))["input_ids"])  # type: ignore[operator]
        words *= 2
    return tuple(ids[:num_tokens])


def small_chat_workload(num_requests: int) -> Workload:
    """A bench workload short enough for a test: 16-48 prompt tokens, 8 output tokens, two
    requests at one in flight, then `num_requests` at 1 req/s, under a loose SLO."""
    return Workload.model_validate(
        {
            "name": "tiny-chat",
            "prompt_tokens": {"kind": "uniform", "low": 16, "high": 48},
            "output_tokens": {"kind": "fixed", "value": 8},
            "num_requests": num_requests,
            "low_load_requests": 2,
            "rates": [1.0],
            "slo": {"ttft_s": 5.0, "tpot_s": 1.0},
        }
    )
