"""What pdserve adds to Ray Serve's proxies, through the one hook Serve gives: the import path
in `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, which Serve calls in each proxy process as it
starts, before its HTTP and gRPC servers start, for a list of HTTP middlewares.

`install` (that import path) makes the gRPC listener follow the environment
(api/grpc_listener.py: host, TLS) and returns the in-flight gate's HTTP middleware when the
environment sets a capacity (api/proxy_gate.py; the gRPC side of the gate is put in place where
our servicer is registered, api/serve_grpc.py).
"""

from __future__ import annotations

from typing import Any

from api import grpc_listener, proxy_gate

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


def proxy_env(
    host: str | None,
    tls: tuple[str, str] | None,
    max_in_flight: int = 0,
    app: str = "",
) -> dict[str, str]:
    """The environment of a node whose Serve proxies bind `host` (None: every interface), serve
    TLS with `tls` (certificate, key), and refuse generation calls past `max_in_flight` (0: no
    gate) in flight through each proxy, counted for `app`."""
    env = {CALLBACK_ENV: f"{__name__}.install", **grpc_listener.listener_env(host, tls)}
    if max_in_flight:
        env[proxy_gate.MAX_IN_FLIGHT_ENV] = str(max_in_flight)
        env[proxy_gate.APP_ENV] = app
    return env


def install() -> list[Any]:
    from starlette.middleware import Middleware

    grpc_listener.replace_binder()
    gate = proxy_gate.proxy_gate()
    return [Middleware(proxy_gate.HttpGate, gate=gate)] if gate is not None else []
