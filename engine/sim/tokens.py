"""What the sim engine "samples": real token ids of the served tokenizer, a pure function of
the prompt, the seed and the position, so a prefill replica and a decode replica (different
processes) draw the same first token and every run of a request streams the same text."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: one well-spread 64-bit value per input."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class TokenSource:
    """Draws from `token_ids` (the vocabulary less its special tokens)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("a token source needs at least one token id")
        self.token_ids = tuple(token_ids)

    @classmethod
    def for_model(cls, model: Path) -> TokenSource:
        """The ordinary tokens of the model folder's `tokenizer.json` (no tokenizer library:
        a sim replica loads no transformers)."""
        raw = json.loads((model / "tokenizer.json").read_text())
        special = {int(t["id"]) for t in raw.get("added_tokens", [])}
        vocab = raw["model"]["vocab"]
        ids = vocab.values() if isinstance(vocab, dict) else range(len(vocab))
        return cls(sorted(i for i in ids if i not in special))

    @staticmethod
    def request_seed(prompt_token_ids: Sequence[int], seed: int | None) -> int:
        digest = hashlib.blake2b(repr((tuple(prompt_token_ids), seed)).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little")

    def token(self, request_seed: int, index: int) -> int:
        """The `index`-th output token of a request."""
        return self.token_ids[_mix(request_seed ^ index) % len(self.token_ids)]
