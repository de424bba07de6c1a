"""Request validation at the router's edge: every bad field named, good bodies typed exactly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.params import GenerationParams, StructuredOutput
from router.validation import (
    ChatMessage,
    InvalidRequest,
    RequestLimits,
    ValidatedRequest,
    fit_to_context,
    validate_request,
)

LIMITS = RequestLimits(
    served_models=frozenset({"smollm2", "tiny"}), default_model="smollm2", max_tokens_limit=4096
)


def make_body(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": "Hello there"}
    body.update(fields)
    return {key: value for key, value in body.items() if value is not ...}


def chat(*messages: Any) -> dict[str, Any]:
    return make_body(prompt=..., messages=list(messages))


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (make_body(prompt=...), "prompt", "required"),
        (make_body(prompt=""), "prompt", "empty"),
        (make_body(prompt=None), "prompt", "required"),
        (make_body(prompt=["a", "b"]), "prompt", "must be a string, got list"),
        (make_body(prompt=[1, 2, 3]), "prompt", "must be a string"),
        (make_body(messages=[{"role": "user", "content": "hi"}]), "prompt", "not both"),
        (make_body(prompt="x" * 101), "prompt", "at most 100"),
        (make_body(max_tokens="16"), "max_tokens", "must be an integer, got str"),
        (make_body(max_tokens=True), "max_tokens", "must be an integer, got bool"),
        (make_body(max_tokens=2.0), "max_tokens", "must be an integer, got float"),
        (make_body(max_tokens=0), "max_tokens", "in [1, 4096]"),
        (make_body(max_tokens=-5), "max_tokens", "in [1, 4096]"),
        (make_body(max_tokens=4097), "max_tokens", "in [1, 4096]"),
        (make_body(temperature=-0.1), "temperature", "in [0, 2]"),
        (make_body(temperature=2.01), "temperature", "in [0, 2]"),
        (make_body(temperature=float("nan")), "temperature", "in [0, 2]"),
        (make_body(temperature="0.5"), "temperature", "must be a number, got str"),
        (make_body(temperature=False), "temperature", "must be a number, got bool"),
        (make_body(top_p=0.0), "top_p", "in (0, 1]"),
        (make_body(top_p=1.5), "top_p", "in (0, 1]"),
        (make_body(top_k=-2), "top_k", ">= -1 (0 or -1 disables it)"),
        (make_body(top_k=3.5), "top_k", "must be an integer"),
        (make_body(seed=-(2**63) - 1), "seed", "in [-9223372036854775808, "),
        (make_body(seed=2**63), "seed", "in [-9223372036854775808, "),
        (make_body(stream="yes"), "stream", "true or false"),
        (make_body(ignore_eos=1), "ignore_eos", "true or false"),
        (make_body(stop=[1]), "stop", "list of strings"),
        (make_body(stop=["a", "b", "c", "d", "e"]), "stop", "1 to 4"),
        (make_body(stop=""), "stop", "non-empty"),
        (make_body(model="gpt-4"), "model", "'gpt-4' is not served here; served: smollm2, tiny"),
        (make_body(model=["tiny"]), "model", "must be a string"),
        (make_body(n=9), "n", "in [1, 8]"),
        (make_body(n=True), "n", "must be an integer"),
        (make_body(n=2, seed=2**63 - 1), "seed", "plus n - 1"),
        (make_body(echo=True), "echo", "not supported by pdserve; send False or None"),
        (make_body(logprobs=21), "logprobs", "in [0, 20]"),
        # Structured output: one constraint, well formed, bounded.
        (make_body(response_format={"type": "xml"}), "response_format.type", "got 'xml'"),
        (make_body(response_format="json"), "response_format", "must be an object"),
        (
            make_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
            "got null",
        ),
        (
            make_body(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "structured_outputs",
            "other than text",
        ),
        (make_body(structured_outputs={}), "structured_outputs", "exactly one of"),
        (
            make_body(structured_outputs={"regex": "a", "choice": ["a"]}),
            "structured_outputs",
            "got 2",
        ),
        (
            make_body(structured_outputs={"structural_tag": "{}"}),
            "structured_outputs.structural_tag",
            "not supported",
        ),
        (make_body(structured_outputs={"choice": []}), "structured_outputs.choice", "one or more"),
        (make_body(structured_outputs={"regex": 7}), "structured_outputs.regex", "got int"),
        (
            make_body(structured_outputs={"json_object": False}),
            "structured_outputs.json_object",
            "must be true",
        ),
        (
            make_body(structured_outputs={"grammar": "x" * 65_537}),
            "structured_outputs.grammar",
            "65537 characters; at most 65536",
        ),
        (make_body(structured_outputs={"regex": "\ud800"}), "structured_outputs.regex", "Unicode"),
        (make_body(stream_options={"include_usage": True}), "stream_options", "stream: true"),
        (make_body(stream=True, stream_options=[]), "stream_options", "must be an object"),
        (
            make_body(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage",
            "true or false",
        ),
        (make_body(stop_token_ids=[1, -2]), "stop_token_ids", "list of token ids"),
        (make_body(min_tokens=65), "min_tokens", "in [0, 64]"),
        (make_body(presence_penalty=2.5), "presence_penalty", "in [-2, 2]"),
        (make_body(repetition_penalty=0), "repetition_penalty", "must be in (0, "),
        (make_body(min_p=1.5), "min_p", "in [0, 1]"),
        (make_body(add_special_tokens="no"), "add_special_tokens", "true or false"),
        (chat(), "messages", "at least one message"),
        (make_body(prompt=..., messages="hi"), "messages", "must be a list"),
        (chat({"role": "robot", "content": "hi"}), "messages[0].role", "must be one of"),
        (chat({"content": "hi"}), "messages[0].role", "got None"),
        (chat({"role": "user", "content": 5}), "messages[0].content", "got int"),
        (chat({"role": "user"}), "messages[0].content", "got null"),
        (chat("hi"), "messages[0]", "must be an object, got str"),
        (
            chat({"role": "system", "content": "be brief"}, {"role": "user", "content": ["x"]}),
            "messages[1].content[0]",
            '"type": "text"',
        ),
        (
            chat({"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}),
            "messages[0].content[0]",
            '"type": "text"',
        ),
        (
            chat({"role": "user", "content": [{"type": "text", "text": None}]}),
            "messages[0].content[0].text",
            "must be a string",
        ),
        (chat({"role": "user", "content": "hi", "name": 5}), "messages[0].name", "got int"),
        (
            chat({"role": "user", "content": "hi", "tool_calls": []}),
            "messages[0].tool_calls",
            "not ",
        ),
        (chat({"role": "user", "content": ""}), "messages", "non-empty content"),
        # Bounded inputs: a stop string's length (scanned on every token), the message count.
        (make_body(stop=["x" * 257]), "stop", "257-character string; at most 256"),
        (make_body(stop=["x" * 100_000] * 5), "stop", "1 to 4 non-empty strings, got 5"),
        (chat(*[{"role": "user", "content": "hi"}] * 1025), "messages", "1025 messages; at most"),
        # Lone surrogates parse from JSON ("\\ud800") but no tokenizer can encode them.
        (make_body(prompt="ok \ud800"), "prompt", "not valid Unicode text"),
        (chat({"role": "user", "content": "\udfff"}), "messages[0].content", "not valid Unicode"),
        (make_body(stop=["\ud800"]), "stop", "not valid Unicode text"),
    ],
)
def test_bad_bodies_raise_naming_the_field(body: dict[str, Any], field: str, words: str) -> None:
    limits = replace(LIMITS, max_prompt_chars=100)
    with pytest.raises(InvalidRequest) as raised:
        validate_request(body, limits)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")
    assert words in str(raised.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "integer"}},
                }
            },
            StructuredOutput("json", '{"type": "integer"}'),
        ),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutput("regex", "[0-9]{3}")),
        (
            {"structured_outputs": {"choice": ["yes", "no"], "json": None}},
            StructuredOutput("choice", ("yes", "no")),
        ),
        (
            {"structured_outputs": {"json": {"type": "string"}}},
            StructuredOutput("json", '{"type": "string"}'),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutput("grammar", 'root ::= "a"'),
        ),
    ],
)
def test_structured_output_is_typed_for_the_engine(
    fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    validated = validate_request(make_body(**fields), LIMITS)
    assert validated.params.structured == expected
    assert (validated.structured_field is None) == (expected is None)
    if expected is not None:
        assert len(expected.vllm_kwargs()) == 1


def test_a_refused_huge_value_is_not_echoed_whole() -> None:
    with pytest.raises(InvalidRequest) as raised:
        validate_request(make_body(stop=["x" * 100_000] * 5), LIMITS)
    assert len(str(raised.value)) < 300


def test_model_is_required_without_a_default() -> None:
    limits = RequestLimits(served_models=frozenset({"tiny"}))
    with pytest.raises(InvalidRequest, match=r"^model: is required$"):
        validate_request(make_body(), limits)


def test_non_object_body_is_refused() -> None:
    with pytest.raises(InvalidRequest) as raised:
        validate_request(["prompt"], LIMITS)  # type: ignore[arg-type]
    assert raised.value.field == "body"


def test_minimal_prompt_gets_the_defaults() -> None:
    assert validate_request({"prompt": "Hi"}, LIMITS) == ValidatedRequest(
        model="smollm2",
        prompt="Hi",
        messages=None,
        params=GenerationParams(max_tokens=64),
        stream=False,
        stop=(),
        is_max_tokens_explicit=False,
    )


def test_full_prompt_body_is_typed_exactly() -> None:
    body = {
        "model": "tiny",
        "prompt": "Once upon",
        "max_tokens": 4096,
        "temperature": 1,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stream": True,
        "stop": "\n\n",
        "ignore_eos": True,
    }
    request = validate_request(body, LIMITS)
    assert request == ValidatedRequest(
        model="tiny",
        prompt="Once upon",
        messages=None,
        params=GenerationParams(
            max_tokens=4096, temperature=1.0, top_p=0.9, top_k=40, seed=7, ignore_eos=True
        ),
        stream=True,
        stop=("\n\n",),
        is_max_tokens_explicit=True,
    )
    assert isinstance(request.params.temperature, float)
    assert not request.is_chat and request.prompt_field == "prompt"


def test_chat_messages_are_typed_and_text_parts_joined() -> None:
    body = chat(
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}],
        },
        {"role": "assistant", "content": ""},
    )
    request = validate_request({**body, "stop": ["a", "b"], "temperature": None}, LIMITS)
    assert request.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi you"),
        ChatMessage("assistant", ""),
    )
    assert request.prompt is None and request.is_chat and request.prompt_field == "messages"
    assert request.stop == ("a", "b")
    assert request.params.is_greedy


def test_limits_are_checked_once_at_start_up() -> None:
    with pytest.raises(ValueError, match="default_model"):
        RequestLimits(served_models=frozenset({"tiny"}), default_model="other")
    with pytest.raises(ValueError, match="served_models"):
        RequestLimits(served_models=frozenset())
    with pytest.raises(ValueError, match="max_tokens_limit"):
        RequestLimits(served_models=frozenset({"tiny"}), max_tokens_limit=10**6)


def test_fit_to_context_keeps_params_that_fit() -> None:
    request = validate_request(make_body(max_tokens=24), LIMITS)
    assert fit_to_context(request, num_prompt_tokens=1000, max_model_len=1024) == request.params


@pytest.mark.parametrize(
    ("body", "num_prompt_tokens", "field", "words"),
    [
        (make_body(), 2048, "prompt", "is 2048 tokens; this model's context is 2048 tokens"),
        (make_body(), 4000, "prompt", "at most 2047 tokens"),
        (chat({"role": "user", "content": "hi"}), 2048, "messages", "context is 2048"),
        (make_body(max_tokens=49), 2000, "max_tokens", "must be in [1, 48] for this 2000-token"),
        (make_body(), 0, "prompt", "zero tokens"),
    ],
)
def test_fit_to_context_rejects(
    body: dict[str, Any], num_prompt_tokens: int, field: str, words: str
) -> None:
    request = validate_request(body, LIMITS)
    with pytest.raises(InvalidRequest) as raised:
        fit_to_context(request, num_prompt_tokens, max_model_len=2048)
    assert raised.value.field == field
    assert words in str(raised.value)


def test_fit_to_context_clamps_only_a_default_max_tokens() -> None:
    request = validate_request(make_body(), LIMITS)  # default 64 tokens
    params = fit_to_context(request, num_prompt_tokens=2040, max_model_len=2048)
    assert params == GenerationParams(max_tokens=8)
    assert fit_to_context(request, 2047, 2048).max_tokens == 1


@settings(max_examples=100, deadline=None)
@given(
    body=st.fixed_dictionaries(
        {"prompt": st.one_of(st.none(), st.text(max_size=5), st.integers(), st.lists(st.text()))},
        optional={
            "max_tokens": st.one_of(st.integers(-10, 5000), st.floats(), st.booleans(), st.text()),
            "temperature": st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.none()),
            "top_p": st.one_of(st.floats(-1, 2), st.booleans()),
            "top_k": st.one_of(st.integers(-3, 100), st.floats()),
            "seed": st.one_of(st.integers(-(2**64), 2**64), st.none()),
            "model": st.sampled_from(["tiny", "smollm2", "gpt", 3]),
        },
    )
)
def test_validation_either_raises_invalid_request_or_yields_valid_params(
    body: dict[str, Any],
) -> None:
    try:
        request = validate_request(body, LIMITS)
    except InvalidRequest as error:
        assert error.field in body or error.field == "prompt"
        return
    assert request.prompt
    assert 1 <= request.params.max_tokens <= LIMITS.max_tokens_limit
    assert request.model in LIMITS.served_models
