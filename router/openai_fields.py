"""The request fields of vLLM's OpenAI server, and what pdserve does with each.

vLLM 0.32's `CompletionRequest` and `ChatCompletionRequest` (vllm.entrypoints.openai.*.protocol)
have about 70 fields and ignore any other (pydantic `extra="allow"`). pdserve accepts the same
set, so vLLM's clients and `vllm bench serve` work unchanged:

- HONOURED: validated in router/validation.py and carried to both pools (sampling) or used by
  the router (stream options, stop strings, special tokens).
- IGNORED: accepted and without effect on the tokens (who sent it, scheduling hints, tool
  choices without tools).
- AT_DEFAULT_ONLY: would change the answer or the response's shape, and pdserve does not do it
  (yet); accepted at vLLM's default value (or null), else a 400 naming the field.

The router does not import vLLM's own models: that import takes ~7 s and brings torch into
every router process. tests/unit/test_openai_fields.py checks these tables against vLLM's
models, so a vLLM upgrade that adds a field fails there, not at a client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HONOURED = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream"}
    | {"stream_options", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p"}
    | {"seed", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty"}
    | {"repetition_penalty", "add_special_tokens", "request_id", "n", "logprobs", "top_logprobs"}
    | {"response_format", "structured_outputs"}
)

IGNORED = frozenset(
    {"user", "session_id", "priority", "stream_interval", "parallel_tool_calls"}
    | {"include_reasoning", "truncation_side", "mm_payload", "spaces_between_special_tokens"}
)

# field -> the values that mean "vLLM's default" (null always does).
AT_DEFAULT_ONLY: Mapping[str, tuple[Any, ...]] = {
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "logit_bias": ({},),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logprob_token_ids": (),
    "truncate_prompt_tokens": (),
    "prompt_embeds": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": ({},),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "watermarking": (False,),
    "return_token_ids": (False,),
    "return_tokens_as_token_ids": (False,),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    "return_mm_kwargs": (False,),
    "routed_experts_prompt_start": (0,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "tools": ([],),
    "tool_choice": ("none",),
    "reasoning_effort": (),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
}

KNOWN = HONOURED | IGNORED | frozenset(AT_DEFAULT_ONLY)


def first_unsupported(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, why) for the first field pdserve cannot honour at the value sent, else None."""
    for field, defaults in AT_DEFAULT_ONLY.items():
        value = body.get(field)
        if value is None or _is_default(value, defaults):
            continue
        allowed = " or ".join(repr(d) for d in (*defaults, None))
        return field, f"is not supported by pdserve; send {allowed} or leave it out"
    return None


def _is_default(value: object, defaults: tuple[Any, ...]) -> bool:
    # bool is an int subclass: `false` is not the default 0 of a count, nor `true` a 1.
    return any(
        (type(value) is type(default) and value == default)
        or (
            isinstance(default, float)
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value == default
        )
        for default in defaults
    )


# vLLM's defaults for what a request leaves out, where the model's generation_config says
# nothing (CompletionRequest._DEFAULT_SAMPLING_PARAMS): sampling at temperature 1.
VLLM_SAMPLING_DEFAULTS: Mapping[str, float] = {"temperature": 1.0}
# generation_config.json keys vLLM takes as request defaults (ModelConfig.get_diff_sampling_param).
_GENERATION_CONFIG_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)


def sampling_defaults(model_path: Path) -> dict[str, float]:
    """The OpenAI surface's defaults for a request's sampling fields, as vLLM's server takes
    them: the model's generation_config.json where it sets any of them, else vLLM's own."""
    path = model_path / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    found = {k: config[k] for k in _GENERATION_CONFIG_KEYS if config.get(k) is not None}
    return found or dict(VLLM_SAMPLING_DEFAULTS)


def with_defaults(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`body` with each default filled in where the field is missing or null."""
    filled = dict(body)
    for name, value in defaults.items():
        if filled.get(name) is None:
            filled[name] = value
    return filled
