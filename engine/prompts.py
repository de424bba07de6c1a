"""Prompt text to token ids, the same way for the engine, the oracle and the router."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids for `text`; with `chat`, as one user turn in the model's chat template."""
    if not text:
        raise ValueError("prompt must not be empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain prompt")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ValueError("prompt encodes to zero tokens")
    return ids


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
