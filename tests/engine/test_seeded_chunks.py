"""A seeded sampled request whose prompt is prefilled in chunks, on the CPU build: the chunks
whose sample is dropped leave its random stream where it was (engine/vllm_plugin.py), so the
answer equals the unchunked one's, and the EngineCore lives (vLLM's own rewind of a GPU
generator's offset killed it: `CPU Generator does not use offset`).

Both engines run in a process of their own: in-process engines share vLLM's global parallel
state, which an earlier test's engine may have torn down in the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]

_BOTH_ENGINES = """
import json, sys
from pathlib import Path
from engine.local import LocalEngine
from engine.params import GenerationParams
from tests.builders import make_settings, prompt_of_length

model = Path(sys.argv[1])
params = GenerationParams(max_tokens=16, temperature=1.0, seed=7)
whole_engine = LocalEngine(make_settings(model))
prompt = list(prompt_of_length(whole_engine.tokenizer, 300))
whole = whole_engine.generate([prompt], params)[0].token_ids
# 300 tokens at 64 a step: four steps whose sample is dropped, then the first token; a request
# beside it is sampled in the same steps.
chunked_engine = LocalEngine(make_settings(model, max_num_batched_tokens=64))
chunked = chunked_engine.generate([prompt, prompt[:40]], params)
print(json.dumps([whole, chunked[0].token_ids, chunked[1].token_ids]))
"""


def test_a_seeded_answer_is_the_same_chunked_or_not(tiny_model: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BOTH_ENGINES, str(tiny_model)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    whole, chunked, beside = json.loads(proc.stdout.strip().splitlines()[-1])
    assert chunked == whole
    assert len(whole) == 16 and len(beside) == 16
