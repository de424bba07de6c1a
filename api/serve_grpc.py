"""`pdserve.v1.PDServeService` as registered on Ray Serve's gRPC proxy: the generated handlers,
with a request parser that does not fail inside the proxy.

The proxy parses each request with the handler's deserializer before any of our code runs; a
corrupt message would end the call as UNKNOWN ("Wire format was corrupt"). Here a message that
does not parse becomes a `MalformedRequest`, which the router answers with INVALID_ARGUMENT.
Name this module's function in `grpc_servicer_functions` instead of the generated one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from api.gen.pdserve.v1 import pdserve_pb2_grpc
from api.proxy_gate import gated_factory, proxy_gate

SERVICE = "pdserve.v1.PDServeService"


@dataclass(frozen=True)
class MalformedRequest:
    """A request body that is not a valid protobuf of the method's request type."""

    error: str


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc))

    return parse_or_mark


class _Recorder:
    """Stands in for a grpc.Server to capture the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers = handlers


def add_PDServeServicer_to_server(servicer: Any, server: Any) -> None:
    """The generated `add_PDServeServiceServicer_to_server`, with the tolerant parsers, and in a
    proxy whose environment sets a capacity, the in-flight gate around the generation methods
    (api/proxy_gate.py). Its name is the one the Serve configs give
    (`api.serve_grpc.add_PDServeServicer_to_server`)."""
    import grpc

    recorder = _Recorder()
    pdserve_pb2_grpc.add_PDServeServiceServicer_to_server(servicer, recorder)
    handlers = {
        name: handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        for name, handler in recorder.handlers.items()
    }
    gate = proxy_gate()
    if gate is not None and hasattr(server, "service_handler_factory"):  # Serve's gRPC proxy
        server.service_handler_factory = gated_factory(server.service_handler_factory, gate)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
