"""One generation request as the pools see it: token ids in, parameters validated."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from engine.params import GenerationParams


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: GenerationParams

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_pinned_seed(self) -> GenerationRequest:
        """Sampled requests get a seed, so prefill and decode draw the same random stream and
        the token decode continues from is the token prefill streamed."""
        if self.params.is_greedy or self.params.seed is not None:
            return self
        params = replace(self.params, seed=secrets.randbits(63))
        return replace(self, params=params)
