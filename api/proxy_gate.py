"""An in-flight gate in Serve's proxies: a generation call past the app's admission capacity is
refused in the proxy that received it, before the call crosses to a router replica.

The router's own admission (router/admission.py) stays the authority: it refuses by calls and by
unprefilled prompt tokens, across all of its callers. Its refusals cost each call a hop from
the proxy to a router replica and back (a Serve handle call: about 20 ms of a loaded core here,
so a burst of 200 waited seconds for its 429s; docs/benchmarks.md). The gate counts the
generation calls this proxy has in flight and refuses once they reach the capacity it was
given, `router.max_in_flight` times the router replicas: a call it refuses is one the routers
would refuse too (the proxy's calls are a part of theirs), so it never refuses what the routers
would admit. It is set up by the proxy callback (`api.proxy_callback.install`) from the environment:

  PDSERVE_PROXY_MAX_IN_FLIGHT   the capacity (unset or 0: no gate)
  PDSERVE_PROXY_APP             the app, for the refusals' `pdserve_requests_total` series

Refusals: HTTP 429 with OpenAI's error body, gRPC RESOURCE_EXHAUSTED; both counted as
`outcome="overloaded"`, as the router counts its own.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

MAX_IN_FLIGHT_ENV = "PDSERVE_PROXY_MAX_IN_FLIGHT"
APP_ENV = "PDSERVE_PROXY_APP"

# The calls that generate (and so are admitted by the router); health and model listing pass.
GRPC_METHODS = frozenset(
    {"/pdserve.v1.PDServeService/Generate", "/pdserve.v1.PDServeService/Complete"}
)
HTTP_PATHS = ("/v1/completions", "/v1/chat/completions")


class InFlightGate:
    """Counts calls in flight; `enter` is False (and counts the refusal) once `capacity` are."""

    def __init__(self, capacity: int, on_refusal: Callable[[], None] = lambda: None) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.num_refused = 0
        self._on_refusal = on_refusal

    @property
    def message(self) -> str:
        return (
            f"server is at capacity ({self.in_flight} of {self.capacity} calls in flight "
            "through this proxy); retry later"
        )

    def enter(self) -> bool:
        if self.in_flight >= self.capacity:
            self.num_refused += 1
            self._on_refusal()
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


def gate_from_env(environ: Mapping[str, str]) -> InFlightGate | None:
    capacity = int(environ.get(MAX_IN_FLIGHT_ENV) or 0)
    if capacity <= 0:
        return None
    return InFlightGate(capacity, _refusal_counter(environ.get(APP_ENV, "")))


def _refusal_counter(app: str) -> Callable[[], None]:
    """Counts a refusal beside the router's (same metric, same tags)."""
    try:
        from ray.util.metrics import Counter

        counter = Counter(
            "pdserve_requests_total", "requests by outcome", tag_keys=("app", "outcome")
        )
    except Exception:  # outside a Ray worker: nothing exports metrics
        return lambda: None
    tags = {"app": app, "outcome": "overloaded"}
    return lambda: counter.inc(1, tags=tags)


# --- HTTP: an ASGI middleware on Serve's HTTP proxy ----------------------------------------

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class HttpGate:
    """Refuses POSTs to the OpenAI generation paths past the gate with 429."""

    def __init__(self, app: ASGIApp, gate: InFlightGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        gated = (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and str(scope.get("path", "")).endswith(HTTP_PATHS)
        )
        if not gated:
            await self.app(scope, receive, send)
            return
        if not self.gate.enter():
            await _send_429(send, self.gate.message)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave()


async def _send_429(send: Any, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "rate_limit_exceeded", "param": None, "code": 429}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- gRPC: around the handlers Serve's gRPC proxy makes for our service ----------------------

Factory = Callable[..., Any]


def gated_factory(factory: Factory, gate: InFlightGate) -> Factory:
    """Serve's gRPC proxy's `service_handler_factory`, with the gate around the generation
    methods: a unary (Complete) or server-streaming (Generate) handler."""

    def make(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if service_method not in GRPC_METHODS:
            return handler
        if getattr(streaming_type, "name", "") == "UNARY_STREAM":
            return _gated_stream(handler, gate)
        if getattr(streaming_type, "name", "") == "UNARY_UNARY":
            return _gated_unary(handler, gate)
        return handler

    return make


def _refuse(context: Any, gate: InFlightGate) -> None:
    import grpc

    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
    context.set_details(gate.message)


def _gated_unary(handler: Any, gate: InFlightGate) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        if not gate.enter():
            _refuse(context, gate)
            return b""
        try:
            return await handler(request, context)
        finally:
            gate.leave()

    return unary


def _gated_stream(handler: Any, gate: InFlightGate) -> Any:
    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        if not gate.enter():
            _refuse(context, gate)
            return
        try:
            async for message in handler(request, context):
                yield message
        finally:
            gate.leave()

    return stream


@functools.cache
def proxy_gate() -> InFlightGate | None:
    """This proxy process's gate, made once from its environment: its HTTP and gRPC servers
    share it, so the count is of both."""
    return gate_from_env(os.environ)
