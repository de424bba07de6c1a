"""pdserve's OpenAI surface against vLLM's own protocol models (vLLM is imported here, in the
test, never in the router): the same request fields, the defaults pdserve accepts are vLLM's,
and every response and stream chunk pdserve writes parses as vLLM's response models."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.messages import token_logprobs
from router.admission import AdmissionLimits
from router.openai_api import Reply, merged, sse_events, whole_response
from router.openai_fields import (
    AT_DEFAULT_ONLY,
    HONOURED,
    IGNORED,
    KNOWN,
    sampling_defaults,
    with_defaults,
)
from router.service import RouterService, StreamChunk, Usage
from router.timings import RequestTimings
from router.validation import InvalidRequest, RequestLimits
from tests.fakes import FakeDecode, FakeEngines, FakePrefill, FakeTokenizer

MODEL = "fake"


@pytest.fixture(scope="module")
def vllm_protocol() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest,
        CompletionResponse,
        CompletionStreamResponse,
    )

    return {
        "requests": (CompletionRequest, ChatCompletionRequest),
        "whole": {False: CompletionResponse, True: ChatCompletionResponse},
        "stream": {False: CompletionStreamResponse, True: ChatCompletionStreamResponse},
    }


def test_the_tables_hold_every_vllm_request_field_once(vllm_protocol: dict[str, Any]) -> None:
    completion, chat = vllm_protocol["requests"]
    vllm_fields = set(completion.model_fields) | set(chat.model_fields)
    assert vllm_fields == KNOWN, (sorted(vllm_fields - KNOWN), sorted(KNOWN - vllm_fields))
    assert not (HONOURED & IGNORED) and not (HONOURED | IGNORED) & set(AT_DEFAULT_ONLY)


def test_what_pdserve_accepts_at_default_includes_vllms_default(
    vllm_protocol: dict[str, Any],
) -> None:
    for model in vllm_protocol["requests"]:
        for name, defaults in AT_DEFAULT_ONLY.items():
            if name not in model.model_fields:
                continue
            default = model.model_fields[name].get_default(call_default_factory=True)
            assert default is None or default in defaults, (model.__name__, name, default)


def make_service() -> RouterService:
    return RouterService(
        FakeTokenizer(),
        RequestLimits(served_models=frozenset({MODEL}), default_model=MODEL),
        AdmissionLimits(max_in_flight=8, max_queued_prompt_tokens=1024),
        64,
        FakeEngines(FakePrefill(), FakeDecode("orld")),
    )


def body_for(chat: bool, **fields: Any) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    return {**prompt, "model": MODEL, **fields}


async def stream_events(chat: bool, **fields: Any) -> list[dict[str, Any]]:
    service = make_service()
    prepared = service.choices(service.prepare(body_for(chat, stream=True, **fields), "req-1"))
    streams = [service.stream(p) for p in prepared]
    first = await anext(streams[0])
    reply = Reply(prepared, "chatcmpl-1" if chat else "cmpl-1", 1)
    events = [e.decode() async for e in sse_events(reply, first, merged(streams))]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@pytest.mark.parametrize("chat", [False, True])
async def test_stream_chunks_parse_as_vllms_and_usage_comes_only_when_asked(
    chat: bool, vllm_protocol: dict[str, Any]
) -> None:
    model = vllm_protocol["stream"][chat]
    plain = await stream_events(chat)
    assert all("usage" not in event for event in plain)
    asked = await stream_events(chat, stream_options={"include_usage": True})
    *tokens, usage = asked
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens)
    assert all(event["usage"] is None for event in tokens)
    continuous = await stream_events(
        chat, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    counts = [event["usage"]["completion_tokens"] for event in continuous[:-1]]
    assert counts == list(range(1, len(counts) + 1))
    for event in plain + asked + continuous:
        parsed = model.model_validate(event)
        assert set(event) <= set(type(parsed).model_fields)
        for choice in event["choices"]:
            assert set(choice) <= set(type(parsed.choices[0]).model_fields)
    if chat:  # the role comes once, in the first delta, as vLLM sends it
        assert [("role" in e["choices"][0]["delta"]) for e in plain] == [True] + [False] * (
            len(plain) - 1
        )


@pytest.mark.parametrize("chat", [False, True])
async def test_whole_responses_parse_as_vllms(chat: bool, vllm_protocol: dict[str, Any]) -> None:
    service = make_service()
    prepared = service.choices(service.prepare(body_for(chat, n=3, seed=11), "req-1"))
    assert [p.request.request_id for p in prepared] == ["req-1-0", "req-1-1", "req-1-2"]
    assert [p.request.params.seed for p in prepared] == [11, 12, 13]  # as vLLM seeds choices
    reply = Reply(prepared, "chatcmpl-1" if chat else "cmpl-1", 1)
    body = await whole_response(reply, merged([service.stream(p) for p in prepared]))
    model = vllm_protocol["whole"][chat]
    parsed = model.model_validate(body)
    assert set(body) <= set(model.model_fields)
    assert set(body["choices"][0]) <= set(type(parsed.choices[0]).model_fields)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert (choice["message"]["content"] if chat else choice["text"]) == "World"
    prompt = prepared[0].request.num_prompt_tokens  # counted once, as vLLM does
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 15,
        "total_tokens": prompt + 15,
    }


async def test_n_streams_interleave_each_choice_whole_and_usage_sums() -> None:
    events = await stream_events(False, n=2, stream_options={"include_usage": True})
    *tokens, usage = events
    texts = {0: "", 1: ""}
    for event in tokens:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "World", 1: "World"}
    assert usage["usage"]["completion_tokens"] == 10


def test_token_logprobs_keep_the_sampled_token_then_the_top_by_rank() -> None:
    from vllm.logprobs import Logprob

    candidates = {7: Logprob(-2.5, rank=4), 3: Logprob(-0.1, rank=1), 9: Logprob(-1.0, rank=2)}
    assert token_logprobs(7, candidates, top=2) == ((7, -2.5), (3, -0.1), (9, -1.0))
    assert token_logprobs(3, candidates, top=1) == ((3, -0.1), (3, -0.1))
    assert token_logprobs(3, candidates, top=0) == ((3, -0.1),)


@pytest.mark.parametrize("chat", [False, True])
def test_logprobs_parse_as_vllms_in_chunks_and_whole(
    chat: bool, vllm_protocol: dict[str, Any]
) -> None:
    service = make_service()
    asked = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    prepared = service.prepare(body_for(chat, stream=True, **asked), "req-1")
    assert prepared.request.params.logprobs == 2
    reply = Reply([prepared], "cmpl-1", 1, service.tokenizer)
    entries = (((ord("W"), -0.5), (ord("W"), -0.5), (ord("V"), -1.5)),)
    chunk = StreamChunk("req-1", "W", (ord("W"),), None, RequestTimings(), logprobs=entries)
    event = reply.chunk(0, chunk)
    vllm_protocol["stream"][chat].model_validate(event)
    logprobs = event["choices"][0]["logprobs"]
    if chat:
        (entry,) = logprobs["content"]
        assert (entry["token"], entry["logprob"], entry["bytes"]) == ("W", -0.5, [87])
        assert [t["token"] for t in entry["top_logprobs"]] == ["W", "V"]
    else:
        assert logprobs == {
            "text_offset": [0],
            "token_logprobs": [-0.5],
            "tokens": ["W"],
            "top_logprobs": [{"W": -0.5, "V": -1.5}],
        }
    done = replace(chunk, finish_reason="length", usage=Usage(5, 1))
    whole = reply.whole(["W"], [done], [list(entries)])
    vllm_protocol["whole"][chat].model_validate(whole)
    assert whole["choices"][0]["logprobs"] == logprobs


def test_chat_top_logprobs_need_logprobs() -> None:
    service = make_service()
    with pytest.raises(InvalidRequest) as error:
        service.prepare(body_for(True, top_logprobs=2), "req-1")
    assert error.value.field == "top_logprobs"
    with pytest.raises(InvalidRequest) as error:
        service.prepare(body_for(False, logprobs=21), "req-1")
    assert (error.value.field, "in [0, 20]" in str(error.value)) == ("logprobs", True)


def test_openai_defaults_are_the_models_generation_config_else_vllms(tmp_path: Path) -> None:
    from engine.models import resolve_model

    # The built-in models' generation_config sets no sampling field: vLLM samples at 1.0.
    assert sampling_defaults(resolve_model("tiny")) == {"temperature": 1.0}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "eos_token_id": 2, "top_k": None})
    )
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9}
    body = {"prompt": "x", "temperature": None, "top_p": 0.5}
    assert with_defaults(body, sampling_defaults(tmp_path)) == {
        "prompt": "x",
        "temperature": 0.6,
        "top_p": 0.5,
    }
