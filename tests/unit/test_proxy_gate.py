"""api/proxy_gate.py: the in-flight gate in Serve's proxies. The counting, and both wrappers
around a call that holds its place until released: the ASGI middleware (a real ASGI exchange)
and the gRPC handlers Serve's proxy would make (unary and server-streaming)."""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Any

import grpc

from api.proxy_gate import (
    GRPC_METHODS,
    HttpGate,
    InFlightGate,
    gate_from_env,
    gated_factory,
)


def test_the_gate_refuses_at_capacity_and_counts_each_refusal() -> None:
    refused: list[int] = []
    gate = InFlightGate(2, on_refusal=lambda: refused.append(1))
    assert gate.enter() and gate.enter()
    assert not gate.enter()
    assert (gate.in_flight, gate.num_refused, len(refused)) == (2, 1, 1)
    assert "2 of 2 calls" in gate.message
    gate.leave()
    assert gate.enter()


def test_no_capacity_no_gate() -> None:
    assert gate_from_env({}) is None
    assert gate_from_env({"PDSERVE_PROXY_MAX_IN_FLIGHT": "0"}) is None
    gate = gate_from_env({"PDSERVE_PROXY_MAX_IN_FLIGHT": "7"})
    assert gate is not None and gate.capacity == 7


class _Held:
    """An ASGI app / a Serve handler that answers once released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _http(app: Any, path: str, method: str = "POST") -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


async def test_http_gate_refuses_generation_past_capacity_with_openais_429() -> None:
    held = _Held()
    gate = InFlightGate(2)
    app = HttpGate(held.asgi, gate)
    admitted = [asyncio.create_task(_http(app, "/v1/chat/completions")) for _ in range(2)]
    await asyncio.sleep(0.01)
    status, body = await _http(app, "/v1/completions")
    assert status == 429
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", 429)
    assert held.calls == 2  # the refused call never reached the app
    # What the gate does not count passes while it is full: other paths, other methods.
    other = asyncio.create_task(_http(app, "/v1/models", method="GET"))
    await asyncio.sleep(0.01)
    assert held.calls == 3
    held.release.set()
    assert [await t for t in admitted] == [(200, b"{}"), (200, b"{}")]
    assert (await other)[0] == 200
    assert gate.in_flight == 0
    assert (await _http(app, "/app/v1/completions"))[0] == 200  # under a route prefix


class _Streaming(Enum):
    UNARY_UNARY = 1
    UNARY_STREAM = 2


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def _serve_factory(held: _Held) -> Any:
    """What Serve's proxy's factory makes: handlers that answer bytes once released."""

    def factory(service_method: str, streaming_type: _Streaming) -> Any:
        async def unary(request: bytes, context: _Context) -> bytes:
            held.calls += 1
            await held.release.wait()
            return b"done"

        async def stream(request: bytes, context: _Context) -> Any:
            held.calls += 1
            await held.release.wait()
            yield b"a"
            yield b"b"

        return unary if streaming_type is _Streaming.UNARY_UNARY else stream

    return factory


async def _drain(handler: Any, context: _Context) -> list[bytes]:
    return [message async for message in handler(b"", context)]


async def test_grpc_gate_refuses_generation_past_capacity_with_resource_exhausted() -> None:
    held = _Held()
    gate = InFlightGate(1)
    make = gated_factory(_serve_factory(held), gate)
    generate = make("/pdserve.v1.PDServeService/Generate", _Streaming.UNARY_STREAM)
    complete = make("/pdserve.v1.PDServeService/Complete", _Streaming.UNARY_UNARY)
    health = make("/pdserve.v1.PDServeService/Health", _Streaming.UNARY_UNARY)
    assert {"/pdserve.v1.PDServeService/Generate"} < GRPC_METHODS
    admitted = asyncio.create_task(_drain(generate, _Context()))
    await asyncio.sleep(0.01)
    for handler, streams in ((generate, True), (complete, False)):
        context = _Context()
        answer = await (_drain(handler, context) if streams else handler(b"", context))
        assert answer in ([], b"")
        assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 of 1 calls" in context.details
    passed = asyncio.create_task(health(b"", _Context()))  # not gated
    await asyncio.sleep(0.01)
    assert held.calls == 2
    held.release.set()
    assert await admitted == [b"a", b"b"]
    assert await passed == b"done"
    assert gate.in_flight == 0 and gate.num_refused == 2
    assert await complete(b"", _Context()) == b"done"
