"""Bad input over gRPC and HTTP: INVALID_ARGUMENT / 400 naming the field; overload:
RESOURCE_EXHAUSTED / 429. After each one the app still serves a valid request."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from api.client import collect
from api.gen.pdserve.v1 import pdserve_pb2
from deploy.config import AppConfig, with_sim_engine
from tests.e2e.conftest import ServedApp, ServeProxy, deployed

pytestmark = pytest.mark.engine

LONG_PROMPT = "word " * 3000  # well over the 2048-token context

# (case id, GenerateRequest fields, the field the error must name)
GRPC_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("empty-prompt", {"prompt": ""}, "prompt"),
    ("prompt-too-long", {"prompt": LONG_PROMPT}, "prompt"),
    ("max-tokens-zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max-tokens-negative", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("max-tokens-too-large", {"prompt": "hi", "max_tokens": 1_000_000}, "max_tokens"),
    ("temperature-too-high", {"prompt": "hi", "temperature": 3.0}, "temperature"),
    ("temperature-negative", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("top-p-zero", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("top-p-too-high", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("unknown-model", {"prompt": "hi", "model": "gpt-9"}, "model"),
    ("no-role", {"messages": [pdserve_pb2.ChatMessage(content="x")]}, "messages[0].role"),
    # proto3 enums are open: a number the proto does not define parses, and is refused by name.
    ("unknown-role", {"messages": [pdserve_pb2.ChatMessage(role=99, content="x")]}, "role"),
]


def assert_still_serving(app: ServedApp) -> None:
    with app.client() as client:
        done = collect(client.generate("still there?", max_tokens=4, ignore_eos=True))
    assert done.usage.completion_tokens == 4


@pytest.mark.parametrize(("case", "fields", "field"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_invalid_argument_names_the_field(
    serve_apps: dict[str, ServedApp], case: str, fields: dict[str, Any], field: str
) -> None:
    app = serve_apps["nixl"]
    from api.gen.pdserve.v1 import pdserve_pb2_grpc

    with grpc.insecure_channel(app.grpc_target) as channel:
        stub = pdserve_pb2_grpc.PDServeServiceStub(channel)
        request = pdserve_pb2.GenerateRequest(**fields)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=app.metadata, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details()
    assert_still_serving(app)


def test_grpc_malformed_protobuf_is_rejected(serve_apps: dict[str, ServedApp]) -> None:
    app = serve_apps["nixl"]
    with grpc.insecure_channel(app.grpc_target) as channel:
        raw = channel.unary_stream(
            "/pdserve.v1.PDServeService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\xff\xff\xff\x0f garbage", metadata=app.metadata, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "body" in info.value.details()
    assert_still_serving(app)


def _post(app: ServedApp, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{app.openai_base}/{path}",
        data=body,
        headers={"Content-Type": "application/json", **app.http_headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


HTTP_CASES: list[tuple[str, str, bytes, str]] = [
    ("malformed-json", "completions", b'{"prompt": "hi", ', "body"),
    ("not-an-object", "completions", b'["hi"]', "body"),
    ("empty-prompt", "completions", json.dumps({"prompt": ""}).encode(), "prompt"),
    ("prompt-wrong-type", "completions", json.dumps({"prompt": 42}).encode(), "prompt"),
    (
        "max-tokens-string",
        "completions",
        json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(),
        "max_tokens",
    ),
    (
        "max-tokens-zero",
        "completions",
        json.dumps({"prompt": "hi", "max_tokens": 0}).encode(),
        "max_tokens",
    ),
    (
        "temperature-high",
        "completions",
        json.dumps({"prompt": "hi", "temperature": 9}).encode(),
        "temperature",
    ),
    (
        "unknown-model",
        "completions",
        json.dumps({"prompt": "hi", "model": "nope"}).encode(),
        "model",
    ),
    ("prompt-too-long", "completions", json.dumps({"prompt": LONG_PROMPT}).encode(), "prompt"),
    ("messages-not-list", "chat/completions", json.dumps({"messages": "hi"}).encode(), "messages"),
    ("chat-missing-messages", "chat/completions", json.dumps({"prompt": "hi"}).encode(), "prompt"),
    # JSON that used to give 500s, and unbounded inputs.
    (
        "5000-digit-int",
        "completions",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "body",
    ),
    ("deep-nesting", "completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "body"),
    ("lone-surrogate", "completions", b'{"prompt": "hi \\ud800"}', "prompt"),
    (
        "long-stop-string",
        "completions",
        json.dumps({"prompt": "hi", "stop": ["x" * 100_000] * 4}).encode(),
        "stop",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "field"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES]
)
def test_http_400_names_the_field(
    serve_apps: dict[str, ServedApp], case: str, path: str, body: bytes, field: str
) -> None:
    app = serve_apps["nixl"]
    status, payload = _post(app, path, body)
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"
    assert field in payload["error"]["message"]
    assert_still_serving(app)


def test_http_body_over_the_limit_is_413(serve_apps: dict[str, ServedApp]) -> None:
    app = serve_apps["nixl"]
    limit = app.config.router.max_body_bytes
    status, payload = _post(app, "completions", b'{"prompt": "' + b"x" * limit + b'"}')
    assert status == 413, payload
    assert payload["error"]["param"] == "body" and f"at most {limit}" in payload["error"]["message"]
    assert_still_serving(app)


@pytest.fixture(scope="module")
def admits_two(serve_proxy: ServeProxy) -> Iterator[ServedApp]:
    """A colocated app whose router admits two requests in flight, on a simulated engine
    (cpu-smollm2: about 60 ms a token): admission is the router's, whatever the engine, and
    paced streams outlast a burst on any machine. On the tiny vLLM engine (about 200 tokens a
    second) CI saw held streams end in the router while the loaded proxy still relayed them,
    and 4 of a burst's calls admitted after them."""
    base = AppConfig.model_validate(
        {
            "name": "admits-two",
            "topology": "colocated",
            "engine": {"model": "tiny", "kv_cache_memory_bytes": 64 * 1024**2},
            "router": {"max_in_flight": 2},
            "autoscaling": {"enabled": False},
        }
    )
    config = AppConfig.model_validate(with_sim_engine(base.model_dump(), "cpu-smollm2"))
    with deployed("admits-two", config, serve_proxy) as app:
        yield app


# Held streams: 300 tokens at the profile's ~60 ms each, 18 s in the engine.
HELD_TOKENS = 300


def test_overload_is_resource_exhausted_then_recovers(admits_two: ServedApp) -> None:
    app = admits_two
    with app.client() as client:
        holders = [
            client.generate(f"hold {i}", max_tokens=HELD_TOKENS, ignore_eos=True) for i in range(2)
        ]
        for stream in holders:
            next(stream)  # both admitted and streaming
        assert app.router_in_flight() == 2  # ...as the router counts them
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("one too many", max_tokens=4))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status, payload = _post(app, "completions", json.dumps({"prompt": "too many"}).encode())
        assert status == 429, payload
        for stream in holders:
            stream.close()  # cancels the call: frees the admission slots
    app.wait_router_idle()
    assert_still_serving(app)


def test_a_burst_of_200_past_admission_is_refused_and_the_admitted_finish(
    admits_two: ServedApp,
) -> None:
    """bench/overload.py's burst on the app that admits two: while both held streams are still
    streaming, all 200 more are refused with RESOURCE_EXHAUSTED (no other code, no hang), and
    the held ones finish whole."""
    from bench.overload import run

    app = admits_two
    app.wait_router_idle()  # the last test's cancelled streams may still hold a slot
    report = asyncio.run(
        run(
            app.grpc_target,
            app.metadata,
            hold=2,
            burst=200,
            max_tokens=HELD_TOKENS,
            router_in_flight=app.router_in_flight,
        )
    )
    shown = json.dumps(report)
    # The router still held both when the last burst call ended: every call met a full router.
    assert report["router_in_flight_after_burst"] == 2, shown
    assert report["burst_codes"] == {"RESOURCE_EXHAUSTED": 200}, shown
    assert report["held_codes"] == {"OK": 2} and report["held_full"] == 2, shown
    app.wait_router_idle()
    assert_still_serving(app)
