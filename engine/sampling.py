"""GenerationParams -> vLLM SamplingParams: the one place request parameters meet vLLM."""

from __future__ import annotations

from typing import Any

from engine.params import GenerationParams


def to_sampling_params(
    params: GenerationParams,
    *,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Any:
    from vllm import SamplingParams

    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        max_tokens=params.max_tokens if max_tokens is None else max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        extra_args=extra_args,
    )
