"""Benchmark requests of a workload (deploy/workload.py): prompts of exact token counts, random
dictionary words of the target model's own tokenizer, fresh per request so no prefix-cache hit
shortens a prefill, except the workload's shared prefix (a common system prompt)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from deploy.workload import Workload


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    prompt_tokens: int  # as the model's tokenizer counts the prompt (special tokens included)
    max_tokens: int


_WORD = re.compile(r"^ [a-z]{3,12}$")


class PromptMaker:
    """Random-word prompts of an exact token count for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        words = [i for i in sorted(vocab.values()) if _WORD.match(tokenizer.decode([i]))]
        if len(words) < 100:  # a tiny test tokenizer: any printable, non-special token
            special = set(tokenizer.all_special_ids)
            words = [
                i
                for i in sorted(vocab.values())
                if i not in special and tokenizer.decode([i]).isprintable()
            ]
        self._words = words

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """Text of exactly `num_tokens` tokens (no special tokens), or as close as decoding
        round trips allow."""
        ids = [rng.choice(self._words) for _ in range(num_tokens)]
        text = self._tokenizer.decode(ids)
        again = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(again) > num_tokens:
            text = self._tokenizer.decode(again[:num_tokens])
        return str(text)

    def count(self, text: str) -> int:
        return len(self._tokenizer(text)["input_ids"])


def build_requests(
    workload: Workload, tokenizer: Any, num_requests: int, seed: int = 0, prefix_seed: int = 0
) -> list[BenchRequest]:
    """Fresh prompts for each `seed`; the shared prefix depends on `prefix_seed` only, so every
    batch of one benchmark shares it (a system prompt in steady state)."""
    maker = PromptMaker(tokenizer)
    prefix = ""
    if workload.shared_prefix_tokens:
        prefix = maker.text(workload.shared_prefix_tokens, random.Random(prefix_seed))
    rng = random.Random(seed)
    requests = []
    for index, (prompt_len, output_len) in enumerate(workload.lengths(num_requests, seed)):
        prompt = prefix + maker.text(prompt_len, rng)
        requests.append(BenchRequest(index, prompt, maker.count(prompt), output_len))
    return requests
