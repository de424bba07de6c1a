"""GenerateRequest -> validation body: presence survives the wire, and a gRPC request validates
exactly like the same HTTP JSON body."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.client import build_request
from api.convert import _from_float32, request_to_body, timings_message, usage_message
from api.gen import pdserve_pb2
from engine.params import GenerationParams
from router.validation import KNOWN_FIELDS, InvalidRequest, RequestLimits, validate_request

LIMITS = RequestLimits(served_models=frozenset({"smollm2", "tiny"}), default_model="smollm2")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def over_the_wire(**kwargs: Any) -> dict[str, Any]:
    """The body the server builds from what a client sent: serialized, parsed, converted."""
    request = build_request(**kwargs)
    received = pdserve_pb2.GenerateRequest.FromString(request.SerializeToString())
    return request_to_body(received)


def test_unset_fields_stay_out_of_the_body() -> None:
    assert over_the_wire(prompt="Hello") == {"prompt": "Hello"}
    validated = validate_request(over_the_wire(prompt="Hello"), LIMITS)
    assert validated.model == "smollm2"
    assert validated.params == GenerationParams()
    assert validated.stop == ()
    assert not validated.is_max_tokens_explicit


def test_explicit_zeros_and_false_are_kept() -> None:
    body = over_the_wire(
        prompt="Hi", temperature=0.0, top_k=0, seed=0, ignore_eos=False, max_tokens=0
    )
    assert body == {
        "prompt": "Hi",
        "temperature": 0.0,
        "top_k": 0,
        "seed": 0,
        "ignore_eos": False,
        "max_tokens": 0,
    }
    with pytest.raises(InvalidRequest) as error:
        validate_request(body, LIMITS)
    assert error.value.field == "max_tokens"


def test_every_field_set() -> None:
    body = over_the_wire(
        prompt="Hi",
        model="tiny",
        max_tokens=32,
        temperature=0.7,
        top_p=0.95,
        top_k=40,
        seed=2**63 - 1,
        stop=["\n\n", "END"],
        ignore_eos=True,
        request_id="req-1",
    )
    assert set(body) <= KNOWN_FIELDS  # request_id travels on the message, not in the body
    validated = validate_request(body, LIMITS)
    assert validated.model == "tiny"
    assert validated.stop == ("\n\n", "END")
    assert validated.params == GenerationParams(
        max_tokens=32, temperature=0.7, top_p=0.95, top_k=40, seed=2**63 - 1, ignore_eos=True
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": "Hello", "max_tokens": 7, "temperature": 1.3, "top_p": 0.9},
        {"messages": CHAT, "model": "tiny", "stop": ["x"], "seed": 5},
        {"prompt": "Hello", "top_k": 3, "ignore_eos": True},
    ],
)
def test_validates_like_the_json_body(kwargs: dict[str, Any]) -> None:
    assert validate_request(over_the_wire(**kwargs), LIMITS) == validate_request(kwargs, LIMITS)


def test_chat_messages() -> None:
    body = over_the_wire(messages=CHAT)
    assert body == {"messages": CHAT}
    assert validate_request(body, LIMITS).is_chat


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({}, "prompt", "must not be empty"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": "Hi", "messages": CHAT}, "prompt", "not both"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages", "non-empty content"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role", "must be one of"),
        ({"prompt": "Hi", "model": "gpt-4"}, "model", "not served here"),
        ({"prompt": "Hi", "temperature": 2.1}, "temperature", "got 2.1"),
        ({"prompt": "Hi", "top_p": 0.0}, "top_p", "in (0, 1]"),
        ({"prompt": "Hi", "top_k": -1}, "top_k", ">= 0"),
        ({"prompt": "Hi", "seed": -1}, "seed", "in [0,"),
        ({"prompt": "Hi", "stop": [""]}, "stop", "non-empty"),
    ],
)
def test_bad_fields_are_named(kwargs: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        validate_request(over_the_wire(**kwargs), LIMITS)
    assert error.value.field == field
    assert words in str(error.value)


def test_a_single_stop_string_is_one_stop() -> None:
    assert over_the_wire(prompt="Hi", stop="END")["stop"] == ["END"]


def test_unknown_chat_message_keys_are_refused_by_the_client() -> None:
    with pytest.raises(ValueError, match="'name'"):
        build_request(messages=[{"role": "user", "content": "hi", "name": "bob"}])


@given(st.floats(width=32))
def test_float32_reads_back_as_the_same_float32(value: float) -> None:
    assert struct.pack("<f", _from_float32(value)) == struct.pack("<f", value)


@pytest.mark.parametrize("typed", [0.7, 0.95, 2.1, 1e-3, 1.0, 0.1])
def test_float32_reads_back_as_typed(typed: float) -> None:
    as_float32 = struct.unpack("<f", struct.pack("<f", typed))[0]
    assert _from_float32(as_float32) == typed


@dataclass(frozen=True)
class FakeTimings:
    queue_wait_s: float = 0.01
    prefill_s: float = 0.2
    kv_transfer_s: float = 0.03
    ttft_s: float = 0.25
    decode_start_s: float = 0.26
    mean_tpot_s: float = 0.02
    e2e_s: float = 1.5
    router_replica: str = "router-r1"
    prefill_replica: str = "prefill-p1"
    decode_replica: str = "decode-d1"


def test_timings_message_copies_every_field() -> None:
    timings = FakeTimings()
    message = timings_message(timings)
    fields = [field.name for field in pdserve_pb2.Timings.DESCRIPTOR.fields]
    assert fields == list(FakeTimings.__dataclass_fields__)
    assert all(getattr(message, name) == getattr(timings, name) for name in fields)


def test_usage_message() -> None:
    usage = usage_message(prompt_tokens=12, completion_tokens=34)
    assert (usage.prompt_tokens, usage.completion_tokens) == (12, 34)
