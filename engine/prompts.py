"""Prompt text to token ids, the same way for the engine, the oracle and the router."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class NoChatTemplate(ValueError):
    """Chat messages for a model whose tokenizer has no chat template."""


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a plain prompt (with the tokenizer's special tokens, as vLLM adds them)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of `messages` ({"role", "content"}) in the model's chat template, with the
    generation prompt; the template writes its own special tokens, so none are added by
    default (as vLLM's chat endpoint does)."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("this model has no chat template; send a plain prompt")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
    )
    return encode_text(tokenizer, text, add_special_tokens=add_special_tokens)


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids for `text`; with `chat`, as one user turn in the model's chat template."""
    if not text:
        raise ValueError("prompt must not be empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    ids = encode_text(tokenizer, text)
    if not ids:
        raise ValueError("prompt encodes to zero tokens")
    return ids


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
