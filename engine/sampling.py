"""GenerationParams -> vLLM SamplingParams (or a sim engine's own record of the same fields): the
one place request parameters meet the engine."""

from __future__ import annotations

from typing import Any

from engine.messages import TokenLogprobs, token_logprobs
from engine.params import GenerationParams


def sampling_fields(
    params: GenerationParams,
    *,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    served: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's SamplingParams for `params` (`output_kind` by name).
    `served`: for a worker streaming to the router, which detokenizes itself: each output holds
    only the new token ids (not all so far) and the engine decodes no text."""
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return {
        "max_tokens": params.max_tokens if max_tokens is None else max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        "min_p": params.min_p,
        "min_tokens": params.min_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "logprobs": params.logprobs,
        "structured_outputs": params.structured.vllm_kwargs() if params.structured else None,
        "extra_args": extra_args,
        "output_kind": "DELTA" if served else "CUMULATIVE",
        "detokenize": not served,
    }


def to_sampling_params(params: GenerationParams, **options: Any) -> Any:
    """vLLM's SamplingParams for `params` (`sampling_fields`' options)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    fields = sampling_fields(params, **options)
    fields["output_kind"] = RequestOutputKind[fields["output_kind"]]
    if fields["structured_outputs"] is not None:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


def sampling_params_for(engine: Any, params: GenerationParams, **options: Any) -> Any:
    """What `engine.generate` takes for `params`: vLLM's SamplingParams, or, for an engine that
    makes its own (`make_sampling_params`, the sim engine: a sim replica never imports vLLM),
    that, from the same fields."""
    make = getattr(engine, "make_sampling_params", None)
    if make is not None:
        return make(**sampling_fields(params, **options))
    return to_sampling_params(params, **options)


def logprobs_of(completion: Any, params: GenerationParams) -> tuple[TokenLogprobs, ...] | None:
    """The log-probabilities of a vLLM output's (new) tokens, one entry per token id; None
    when the request asked for none."""
    if params.logprobs is None or getattr(completion, "logprobs", None) is None:
        return None
    return tuple(
        token_logprobs(int(t), candidates, params.logprobs)
        for t, candidates in zip(completion.token_ids, completion.logprobs, strict=True)
    )
