"""vLLM on the CPU against transformers' own generate: token for token, greedy, float32."""

from __future__ import annotations

import pytest

from engine.local import LocalEngine
from engine.reference import ReferenceModel
from tests.builders import long_text, make_greedy

pytestmark = pytest.mark.engine

DEFAULT_PROMPTS = [
    ("The three primary colors are", False),
    ("def fibonacci(n):", False),
    ("What is the capital of France?", True),
    ("Write one sentence about the ocean.", True),
]


@pytest.mark.parametrize(("text", "chat"), DEFAULT_PROMPTS)
def test_default_model_matches_transformers(
    default_engine: LocalEngine, default_reference: ReferenceModel, text: str, chat: bool
) -> None:
    params = make_greedy(max_tokens=32)
    prompt = default_engine.encode(text, chat=chat)
    got = default_engine.generate([prompt], params)[0].token_ids
    want = default_reference.generate(prompt, params)
    assert got == want, (text, got, want)
    assert len(got) >= 4


def test_default_model_knows_paris(default_engine: LocalEngine) -> None:
    prompt = default_engine.encode("What is the capital of France?", chat=True)
    completion = default_engine.generate([prompt], make_greedy(max_tokens=24))[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"


def test_chat_template_is_kept(default_engine: LocalEngine) -> None:
    plain = default_engine.encode("Hello", chat=False)
    chat = default_engine.encode("Hello", chat=True)
    assert chat[0] == 1  # <|im_start|>
    assert len(chat) > len(plain)


@pytest.mark.parametrize(
    "text",
    ["hello world", "x", long_text(40), long_text(400)],
    ids=["short", "one-char", "medium", "long"],
)
def test_tiny_model_matches_transformers(
    tiny_engine: LocalEngine, tiny_reference: ReferenceModel, text: str
) -> None:
    params = make_greedy(max_tokens=32, ignore_eos=True)
    prompt = tiny_engine.encode(text)
    got = tiny_engine.generate([prompt], params)[0].token_ids
    want = tiny_reference.generate(prompt, params)
    assert len(got) == 32
    assert got == want


def test_tiny_batch_equals_one_at_a_time(tiny_engine: LocalEngine) -> None:
    params = make_greedy(max_tokens=16, ignore_eos=True)
    prompts = [tiny_engine.encode(long_text(n)) for n in (3, 17, 60, 111)]
    batched = [c.token_ids for c in tiny_engine.generate(prompts, params)]
    single = [tiny_engine.generate([p], params)[0].token_ids for p in prompts]
    assert batched == single


def test_tiny_chat_template(tiny_engine: LocalEngine) -> None:
    ids = tiny_engine.encode("hi", chat=True)
    text = tiny_engine.tokenizer.decode(ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
