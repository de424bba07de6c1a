"""A seeded sampled request whose prompt is prefilled in chunks, on the CPU build: the chunks
whose sample is dropped leave its random stream where it was (engine/vllm_plugin.py), so the
answer equals the unchunked one's, and the EngineCore lives (vLLM's own rewind of a GPU
generator's offset killed it: `CPU Generator does not use offset`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.local import LocalEngine
from engine.params import GenerationParams
from tests.builders import make_settings, prompt_of_length

pytestmark = pytest.mark.engine


def test_a_seeded_answer_is_the_same_chunked_or_not(
    tiny_model: Path, tiny_engine: LocalEngine
) -> None:
    prompt = list(prompt_of_length(tiny_engine.tokenizer, 300))
    params = GenerationParams(max_tokens=16, temperature=1.0, seed=7)
    whole = tiny_engine.generate([prompt], params)[0]
    chunked_engine = LocalEngine(make_settings(tiny_model, max_num_batched_tokens=64))
    # 300 tokens at 64 a step: four steps whose sample is dropped, then the first token.
    chunked = chunked_engine.generate([prompt, prompt[:40]], params)
    assert chunked[0].token_ids == whole.token_ids
    assert len(chunked[1].token_ids) == 16  # a request beside it, sampled in the same steps
