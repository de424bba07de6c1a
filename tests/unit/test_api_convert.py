"""GenerateRequest -> validation body: presence survives the wire, and a gRPC request validates
exactly like the same HTTP JSON body; the contract's enums <-> the router's strings."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.client import build_complete_request, build_request
from api.convert import (
    InvalidField,
    _from_float32,
    finish_reason_name,
    finish_reason_value,
    pools_message,
    request_to_body,
    role_value,
    timings_message,
    usage_message,
)
from api.gen.pdserve.v1 import pdserve_pb2
from engine.params import GenerationParams
from router.openai_fields import KNOWN as KNOWN_FIELDS
from router.validation import CHAT_ROLES, InvalidRequest, RequestLimits, validate_request

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
        ({"prompt": "Hi", "model": "gpt-4"}, "model", "not served here"),
        ({"prompt": "Hi", "temperature": 2.1}, "temperature", "got 2.1"),
        ({"prompt": "Hi", "top_p": 0.0}, "top_p", "in (0, 1]"),
        ({"prompt": "Hi", "top_k": -2}, "top_k", ">= -1"),
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


def test_complete_requests_convert_like_generate_requests() -> None:
    kwargs: dict[str, Any] = {"messages": CHAT, "max_tokens": 3, "seed": 0, "stop": ["x"]}
    request = build_complete_request(**kwargs)
    assert isinstance(request, pdserve_pb2.CompleteRequest)
    assert request_to_body(request) == over_the_wire(**kwargs)


@pytest.mark.parametrize(
    ("role", "words"),
    [
        (pdserve_pb2.ROLE_UNSPECIFIED, "is required: one of ROLE_SYSTEM"),
        # proto3 enums are open: a number the proto does not define parses.
        (99, "got Role value 99"),
    ],
)
def test_a_role_the_contract_does_not_define_is_named(role: int, words: str) -> None:
    chat = [pdserve_pb2.ChatMessage(role=pdserve_pb2.ROLE_USER, content="Hi")]
    chat.append(pdserve_pb2.ChatMessage(role=role, content="Hi"))  # type: ignore[arg-type]
    sent = pdserve_pb2.GenerateRequest(messages=chat).SerializeToString()
    with pytest.raises(InvalidField) as error:
        request_to_body(pdserve_pb2.GenerateRequest.FromString(sent))
    assert error.value.field == "messages[1].role"
    assert words in str(error.value)


def test_every_role_is_one_validation_accepts() -> None:
    roles = [v for v in pdserve_pb2.Role.values() if v != pdserve_pb2.ROLE_UNSPECIFIED]
    for role in roles:
        body = request_to_body(
            pdserve_pb2.GenerateRequest(messages=[pdserve_pb2.ChatMessage(role=role, content="x")])
        )
        assert body["messages"][0]["role"] in CHAT_ROLES
        assert role_value(body["messages"][0]["role"]) == role


@pytest.mark.parametrize("role", ["robot", "", "unspecified", "USER"])
def test_the_client_refuses_a_role_it_cannot_send(role: str) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]\.role: must be one of"):
        build_request(messages=[{"role": role, "content": "hi"}])


def test_a_chat_message_without_a_role_is_left_for_the_server_to_refuse() -> None:
    (message,) = build_request(messages=[{"content": "hi"}]).messages
    assert message.role == pdserve_pb2.ROLE_UNSPECIFIED


@pytest.mark.parametrize(
    ("reason", "value"),
    [
        (None, pdserve_pb2.FINISH_REASON_UNSPECIFIED),
        ("stop", pdserve_pb2.FINISH_REASON_STOP),
        ("length", pdserve_pb2.FINISH_REASON_LENGTH),
    ],
)
def test_finish_reasons(reason: str | None, value: int) -> None:
    assert finish_reason_value(reason) == value
    assert finish_reason_name(value) == (reason or "")  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", ["abort", "error", "", "STOP", "unspecified"])
def test_a_finish_the_contract_cannot_express_is_an_error(reason: str) -> None:
    with pytest.raises(ValueError, match="FinishReason"):
        finish_reason_value(reason)


def test_pools_in_the_enums_order() -> None:
    pools = pools_message({"decode": 2, "prefill": 1})
    assert [(p.pool, p.ready_replicas) for p in pools] == [
        (pdserve_pb2.POOL_PREFILL, 1),
        (pdserve_pb2.POOL_DECODE, 2),
    ]
    assert [p.pool for p in pools_message({"engine": 1})] == [pdserve_pb2.POOL_ENGINE]
    with pytest.raises(ValueError, match=r"'router' has no pdserve\.v1\.Pool"):
        pools_message({"router": 1})


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
