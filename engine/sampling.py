"""GenerationParams -> vLLM SamplingParams: the one place request parameters meet vLLM."""

from __future__ import annotations

from typing import Any

from engine.params import GenerationParams


def to_sampling_params(
    params: GenerationParams,
    *,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    served: bool = False,
) -> Any:
    """`served`: for a worker streaming to the router, which detokenizes itself: each output
    holds only the new token ids (not all so far) and the engine decodes no text."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        max_tokens=params.max_tokens if max_tokens is None else max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids) or None,
        extra_args=extra_args,
        output_kind=RequestOutputKind.DELTA if served else RequestOutputKind.CUMULATIVE,
        detokenize=not served,
    )
