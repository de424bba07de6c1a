"""Untrusted request bodies -> validated, typed requests. Pure: no I/O, no tokenizer.

Two steps, because the second needs token ids:
1. `validate_request(body, limits)`: the JSON/protobuf body as a plain dict -> `ValidatedRequest`
   (types, ranges, model name, prompt xor chat messages, unknown fields).
2. `fit_to_context(request, num_prompt_tokens, max_model_len)`: once tokenized, the prompt and
   its output must fit the model's context -> the final `GenerationParams`.

    context (max_model_len)  |<---------------------------------------------->|
    request                  |<---- prompt tokens ---->|<--- max_tokens --->|  must fit

An explicit `max_tokens` that does not fit is rejected, as OpenAI-style servers do: silently
returning fewer tokens than asked would look like an early stop. A default `max_tokens` (the
client sent none) is clamped to the room left, as vLLM does.

Every failure is one `InvalidRequest` (a ValueError) naming the field; the edge maps it to
INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.params import (
    MAX_LOGPROBS,
    MAX_TOKENS_LIMIT,
    STRUCTURED_KINDS,
    GenerationParams,
    StructuredOutput,
)
from router.openai_fields import first_unsupported

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
MAX_SEED = 2**63 - 1  # the protobuf field is int64
MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64
_ECHO_CHARS = 80  # how much of a refused value an error message repeats


class InvalidRequest(ValueError):
    """A request field is missing, of the wrong type or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        # True when the request was already counted (refused by an engine after admission).
        self.counted = False

    def __reduce__(self) -> tuple[type[InvalidRequest], tuple[str, str]]:
        # Crosses processes (replica -> Serve proxy): rebuild from both arguments.
        return (type(self), (self.field, self.message))


@dataclass(frozen=True)
class RequestLimits:
    """What this router accepts; built once from the deployment config."""

    served_models: frozenset[str]
    # Used when the body names no model; None makes `model` required.
    default_model: str | None = None
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    default_max_tokens: int = GenerationParams().max_tokens
    # Bounds the tokenizer's work before any token is counted.
    max_prompt_chars: int = 1_000_000
    # The detokenizer scans each stop string on every token: their length bounds its cost.
    max_stop_chars: int = 256
    max_messages: int = 1024
    # The engine compiles a constraint before the first token: its size bounds that work.
    max_structured_chars: int = 65_536
    # Choices per request (OpenAI's `n`): each is a request of its own in the pools.
    max_n: int = 8

    def __post_init__(self) -> None:
        if not self.served_models:
            raise ValueError("served_models must name at least one model")
        if self.default_model is not None and self.default_model not in self.served_models:
            raise ValueError(f"default_model {self.default_model!r} is not a served model")
        if not 1 <= self.max_tokens_limit <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens_limit must be in [1, {MAX_TOKENS_LIMIT}]")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in [1, max_tokens_limit]")
        limits = (self.max_prompt_chars, self.max_stop_chars, self.max_messages)
        if min(*limits, self.max_structured_chars) < 1:
            raise ValueError(
                "max_prompt_chars, max_stop_chars, max_messages and max_structured_chars "
                "must be >= 1"
            )


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ValidatedRequest:
    """A request whose fields all passed validation; exactly one of prompt / messages is set."""

    model: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    params: GenerationParams
    stream: bool = False
    stop: tuple[str, ...] = ()
    # False when max_tokens is the router's default: then it may be clamped to the context.
    is_max_tokens_explicit: bool = True
    # stream_options: usage in a last chunk of its own; usage on every chunk.
    include_usage: bool = False
    continuous_usage: bool = False
    # None: the endpoint's default (prompts get the tokenizer's special tokens, chat does not).
    add_special_tokens: bool | None = None
    n: int = 1
    # The body field that carried a structured-output constraint (for an engine's refusal).
    structured_field: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def prompt_field(self) -> str:
        """The body field that carried the prompt, for errors found after tokenizing."""
        return "messages" if self.is_chat else "prompt"


def validate_request(body: Mapping[str, Any], limits: RequestLimits) -> ValidatedRequest:
    """The body of an OpenAI (or our gRPC) request. Every field of vLLM's request models is
    accepted: those that change the answer are honoured or, where pdserve does not do them,
    refused unless at vLLM's default; fields nobody knows are ignored, as vLLM ignores them."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("body", f"must be an object, got {_type_name(body)}")
    unsupported = first_unsupported(body)
    if unsupported is not None:
        raise InvalidRequest(*unsupported)
    model = _model(body, limits)
    prompt, messages = _prompt_or_messages(body, limits)
    max_tokens = _optional_int(body, "max_completion_tokens", 1, limits.max_tokens_limit)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1, limits.max_tokens_limit)
    resolved_max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
    top_k = _optional_int(body, "top_k", -1, None, hint=" (0 or -1 disables it)") or 0
    structured_field, structured = _structured(body, limits) or (None, None)
    params = GenerationParams(
        max_tokens=resolved_max_tokens,
        temperature=_optional_float(body, "temperature", 0.0, 2.0, default=0.0),
        top_p=_optional_float(body, "top_p", 0.0, 1.0, default=1.0, low_open=True),
        top_k=max(top_k, 0),
        seed=_optional_int(body, "seed", -MAX_SEED - 1, MAX_SEED),
        ignore_eos=_optional_bool(body, "ignore_eos"),
        min_p=_optional_float(body, "min_p", 0.0, 1.0, default=0.0),
        min_tokens=_optional_int(body, "min_tokens", 0, resolved_max_tokens) or 0,
        presence_penalty=_optional_float(body, "presence_penalty", -2.0, 2.0, default=0.0),
        frequency_penalty=_optional_float(body, "frequency_penalty", -2.0, 2.0, default=0.0),
        repetition_penalty=_optional_float(
            body, "repetition_penalty", 0.0, 1e6, default=1.0, low_open=True
        ),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        logprobs=_logprobs(body, is_chat=messages is not None),
        structured=structured,
    )
    n = _optional_int(body, "n", 1, limits.max_n) or 1
    if params.seed is not None and params.seed + n - 1 > MAX_SEED:
        raise InvalidRequest(
            "seed", f"plus n - 1 (choice i samples with seed + i) must be <= {MAX_SEED}"
        )
    stream = _optional_bool(body, "stream")
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    add_special_tokens = body.get("add_special_tokens")
    if add_special_tokens is not None and not isinstance(add_special_tokens, bool):
        raise InvalidRequest(
            "add_special_tokens", f"must be true or false, got {_type_name(add_special_tokens)}"
        )
    return ValidatedRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        params=params,
        stream=stream,
        stop=_stop(body.get("stop"), limits),
        is_max_tokens_explicit=max_tokens is not None,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        add_special_tokens=add_special_tokens,
        n=n,
        structured_field=structured_field,
    )


def fit_to_context(
    request: ValidatedRequest, num_prompt_tokens: int, max_model_len: int
) -> GenerationParams:
    """The request's params once the prompt is tokenized; raises if it cannot fit the context."""
    if num_prompt_tokens < 1:
        raise InvalidRequest(request.prompt_field, "encodes to zero tokens")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequest(
            request.prompt_field,
            f"is {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens, "
            f"so the prompt must be at most {max_model_len - 1} tokens",
        )
    max_tokens = request.params.max_tokens
    if max_tokens <= room:
        return request.params
    if not request.is_max_tokens_explicit:
        return replace(request.params, max_tokens=room)
    raise InvalidRequest(
        "max_tokens",
        f"must be in [1, {room}] for this {num_prompt_tokens}-token prompt "
        f"(context {max_model_len} tokens), got {max_tokens}",
    )


def _model(body: Mapping[str, Any], limits: RequestLimits) -> str:
    model = body.get("model")
    if model is None:
        if limits.default_model is None:
            raise InvalidRequest("model", "is required")
        return limits.default_model
    if not isinstance(model, str):
        raise InvalidRequest("model", f"must be a string, got {_type_name(model)}")
    if model not in limits.served_models:
        served = ", ".join(sorted(limits.served_models))
        raise InvalidRequest("model", f"{model!r} is not served here; served: {served}")
    return model


def _prompt_or_messages(
    body: Mapping[str, Any], limits: RequestLimits
) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    prompt, raw_messages = body.get("prompt"), body.get("messages")
    if prompt is not None and raw_messages is not None:
        raise InvalidRequest("prompt", "send either prompt or messages, not both")
    if prompt is None and raw_messages is None:
        raise InvalidRequest("prompt", "is required (or send chat messages)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", f"must be a string, got {_type_name(prompt)}")
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        _check_chars("prompt", len(prompt), limits)
        _check_text("prompt", prompt)
        return prompt, None
    messages = _messages(raw_messages, limits)
    _check_chars("messages", sum(len(m.content) for m in messages), limits)
    for i, message in enumerate(messages):
        _check_text(f"messages[{i}].content", message.content)
    return None, messages


def _messages(raw: object, limits: RequestLimits) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, list | tuple):
        raise InvalidRequest("messages", f"must be a list of messages, got {_type_name(raw)}")
    if not raw:
        raise InvalidRequest("messages", "must hold at least one message")
    if len(raw) > limits.max_messages:
        raise InvalidRequest(
            "messages", f"holds {len(raw)} messages; at most {limits.max_messages} are accepted"
        )
    messages = tuple(_message(f"messages[{i}]", item) for i, item in enumerate(raw))
    if not any(m.content for m in messages):
        raise InvalidRequest("messages", "must hold at least one message with non-empty content")
    return messages


def _message(field: str, raw: object) -> ChatMessage:
    if not isinstance(raw, Mapping):
        raise InvalidRequest(field, f"must be an object, got {_type_name(raw)}")
    extra = sorted(str(key) for key in raw if key not in ("role", "content", "name"))
    if extra:
        raise InvalidRequest(
            f"{field}.{extra[0]}", "not supported by pdserve; a message has role, content, name"
        )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"{field}.name", f"must be a string, got {_type_name(name)}")
    role = raw.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        allowed = ", ".join(sorted(CHAT_ROLES))
        raise InvalidRequest(f"{field}.role", f"must be one of {allowed}, got {role!r}")
    return ChatMessage(role, _content(f"{field}.content", raw.get("content")))


def _content(field: str, raw: object) -> str:
    """A string, or OpenAI's list of text parts (joined); other part types are refused."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list | tuple):
        raise InvalidRequest(
            field, f"must be a string or a list of text parts, got {_type_name(raw)}"
        )
    texts = []
    for i, part in enumerate(raw):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise InvalidRequest(f"{field}[{i}]", 'must be {"type": "text", "text": ...}')
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{field}[{i}].text", f"must be a string, got {_type_name(text)}")
        texts.append(text)
    return "".join(texts)


def _stop(raw: object, limits: RequestLimits) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = (raw,) if isinstance(raw, str) else raw
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(
            "stop", f"must be a string or a list of strings, got {_echo(repr(raw))}"
        )
    if len(stops) > MAX_STOP_SEQUENCES or not all(stops):
        raise InvalidRequest(
            "stop",
            f"must hold 1 to {MAX_STOP_SEQUENCES} non-empty strings, got {len(stops)} "
            f"({_echo(repr(raw))})",
        )
    longest = max(len(s) for s in stops)
    if longest > limits.max_stop_chars:
        raise InvalidRequest(
            "stop",
            f"holds a {longest}-character string; at most {limits.max_stop_chars} are accepted",
        )
    for stop in stops:
        _check_text("stop", stop)
    return tuple(stops)


def _stop_token_ids(raw: object) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in raw
    ):
        raise InvalidRequest(
            "stop_token_ids", f"must be a list of token ids, got {_echo(repr(raw))}"
        )
    if len(raw) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids", f"holds {len(raw)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted"
        )
    return tuple(raw)


def _logprobs(body: Mapping[str, Any], *, is_chat: bool) -> int | None:
    """How many top log-probabilities to return per token (0: the sampled token's only), or
    None. Completions send a count in `logprobs`; chat sends `logprobs: true` and a count in
    `top_logprobs`."""
    if not is_chat:
        return _optional_int(body, "logprobs", 0, MAX_LOGPROBS)
    wanted = _optional_bool(body, "logprobs")
    top = _optional_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not wanted:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def _structured(
    body: Mapping[str, Any], limits: RequestLimits
) -> tuple[str, StructuredOutput] | None:
    """The constraint of `response_format` (OpenAI: json_object, json_schema) or of vLLM's
    `structured_outputs` (one of json, json_object, regex, choice, grammar), not both, and the
    field that carried it."""
    from_format = _response_format(body.get("response_format"))
    raw = body.get("structured_outputs")
    if raw is None:
        found = from_format
    elif from_format is not None:
        raise InvalidRequest(
            "structured_outputs", "cannot be sent with a response_format other than text"
        )
    else:
        found = _structured_outputs(raw)
    if found is None:
        return None
    field, structured = found
    spec = structured.spec
    if isinstance(spec, bool):  # json_object: nothing to bound
        return found
    size = sum(map(len, spec)) if isinstance(spec, tuple) else len(spec)
    if size > limits.max_structured_chars:
        raise InvalidRequest(
            field,
            f"is {size} characters; at most {limits.max_structured_chars} are accepted",
        )
    return found


def _response_format(raw: object) -> tuple[str, StructuredOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidRequest("response_format", f"must be an object, got {_type_name(raw)}")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutput("json_object", True)
    if kind != "json_schema":
        raise InvalidRequest(
            "response_format.type",
            f"must be text, json_object or json_schema, got {_echo(repr(kind))}",
        )
    json_schema = raw.get("json_schema")
    if not isinstance(json_schema, Mapping):
        raise InvalidRequest(
            "response_format.json_schema", f"must be an object, got {_type_name(json_schema)}"
        )
    schema = json_schema.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequest(
            "response_format.json_schema.schema",
            f"must be a JSON schema object, got {_type_name(schema)}",
        )
    field = "response_format.json_schema.schema"
    return field, StructuredOutput("json", json.dumps(schema))


def _structured_outputs(raw: object) -> tuple[str, StructuredOutput]:
    if not isinstance(raw, Mapping):
        raise InvalidRequest("structured_outputs", f"must be an object, got {_type_name(raw)}")
    for key in raw:
        if key not in STRUCTURED_KINDS:
            raise InvalidRequest(
                f"structured_outputs.{_echo(str(key))}",
                "is not supported by pdserve; send one of " + ", ".join(STRUCTURED_KINDS),
            )
    kinds = [k for k in STRUCTURED_KINDS if raw.get(k) is not None]
    if len(kinds) != 1:
        raise InvalidRequest(
            "structured_outputs",
            "must set exactly one of " + ", ".join(STRUCTURED_KINDS) + f", got {len(kinds)}",
        )
    (kind,) = kinds
    field, value = f"structured_outputs.{kind}", raw[kind]
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(field, f"must be true, got {_echo(repr(value))}")
        return field, StructuredOutput(kind, True)
    if kind == "json":
        if isinstance(value, Mapping):
            return field, StructuredOutput(kind, json.dumps(value))
        if not isinstance(value, str):
            raise InvalidRequest(field, f"must be a JSON schema, got {_type_name(value)}")
        _check_text(field, value)
        return field, StructuredOutput(kind, value)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequest(field, "must be a list of one or more non-empty strings")
        for choice in value:
            _check_text(field, choice)
        return field, StructuredOutput(kind, tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(field, f"must be a non-empty string, got {_type_name(value)}")
    _check_text(field, value)
    return field, StructuredOutput(kind, value)


def _stream_options(raw: object, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); vLLM refuses stream_options without stream."""
    if raw is None:
        return False, False
    if not stream:
        raise InvalidRequest("stream_options", "is only accepted with stream: true")
    if not isinstance(raw, Mapping):
        raise InvalidRequest("stream_options", f"must be an object, got {_type_name(raw)}")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise InvalidRequest(
                f"stream_options.{key}", f"must be true or false, got {_type_name(value)}"
            )
        flags.append(bool(value))
    return flags[0], flags[1]


def _check_text(field: str, text: str) -> None:
    """JSON may carry lone surrogates (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            field, f"is not valid Unicode text ({exc.reason} at position {exc.start})"
        ) from None


def _echo(text: str) -> str:
    return text if len(text) <= _ECHO_CHARS else f"{text[:_ECHO_CHARS]}... ({len(text)} chars)"


def _check_chars(field: str, num_chars: int, limits: RequestLimits) -> None:
    if num_chars > limits.max_prompt_chars:
        raise InvalidRequest(
            field, f"is {num_chars} characters; at most {limits.max_prompt_chars} are accepted"
        )


def _optional_int(
    body: Mapping[str, Any], field: str, low: int, high: int | None, hint: str = ""
) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    # bool is an int subclass: `true` for max_tokens is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(field, f"must be an integer, got {_type_name(value)}")
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(field, f"must be {allowed}{hint}, got {value}")
    return value


def _optional_float(
    body: Mapping[str, Any],
    field: str,
    low: float,
    high: float,
    *,
    default: float,
    low_open: bool = False,
) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(field, f"must be a number, got {_type_name(value)}")
    number = float(value)
    is_above_low = number > low if low_open else number >= low
    if not (math.isfinite(number) and is_above_low and number <= high):
        allowed = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise InvalidRequest(field, f"must be in {allowed}, got {value}")
    return number


def _optional_bool(body: Mapping[str, Any], field: str) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(field, f"must be true or false, got {_type_name(value)}")
    return value


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__
