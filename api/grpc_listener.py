"""Where Ray Serve's gRPC proxy listens, and whether it speaks TLS.

Serve 2.60's proxy takes neither: it binds `[::]:<port>` in plaintext
(ray.serve._private.grpc_util.start_grpc_server, through `default_impl.add_grpc_address`, the
function Ray keeps for deployments to replace). The proxy callback (api/proxy_callback.py) runs
`replace_binder` in each proxy process before its gRPC server starts, so the listener follows
the node's environment:

  PDSERVE_GRPC_HOST       the address to bind (default: every interface, as Serve does)
  PDSERVE_GRPC_TLS_CERT   a PEM certificate (chain) and its key: the proxy serves TLS only
  PDSERVE_GRPC_TLS_KEY

`pdserve up` sets them on its Ray head (`listener_env`); a cluster sets them on each node's
`ray start` (docs/operations.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

HOST_ENV = "PDSERVE_GRPC_HOST"
TLS_CERT_ENV = "PDSERVE_GRPC_TLS_CERT"
TLS_KEY_ENV = "PDSERVE_GRPC_TLS_KEY"


def listener_env(host: str | None, tls: tuple[str, str] | None) -> dict[str, str]:
    """The environment that makes Serve's gRPC proxy bind `host` (None: every interface) and
    serve TLS with `tls` (certificate, key: PEM paths the proxy's node can read)."""
    env = {}
    if host:
        env[HOST_ENV] = host
    if tls:
        env[TLS_CERT_ENV], env[TLS_KEY_ENV] = tls
    return env


def listen_address(serve_address: str, environ: dict[str, str] | os._Environ[str]) -> str:
    """The address to bind instead of Serve's `[::]:<port>`: the same port on $PDSERVE_GRPC_HOST
    (an IPv6 address in brackets, as gRPC wants it)."""
    host = environ.get(HOST_ENV, "").strip()
    if not host:
        return serve_address
    port = serve_address.rsplit(":", 1)[1]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def server_credentials(environ: dict[str, str] | os._Environ[str]) -> Any:
    """TLS credentials from the certificate and key files the environment names; None when it
    names neither. One without the other, or a file that cannot be read, is an error naming it
    (the proxy fails to start, and Serve reports it)."""
    cert, key = environ.get(TLS_CERT_ENV, ""), environ.get(TLS_KEY_ENV, "")
    if not cert and not key:
        return None
    if not cert or not key:
        raise ValueError(f"{TLS_CERT_ENV} and {TLS_KEY_ENV} go together")
    import grpc

    pems = {}
    for name, path in ((TLS_CERT_ENV, cert), (TLS_KEY_ENV, key)):
        try:
            pems[name] = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{name} {path}: {exc.strerror or exc}") from exc
    return grpc.ssl_server_credentials([(pems[TLS_KEY_ENV], pems[TLS_CERT_ENV])])


def bind(server: Any, serve_address: str) -> None:
    """`default_impl.add_grpc_address`, following the environment."""
    address = listen_address(serve_address, os.environ)
    credentials = server_credentials(os.environ)
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)


def replace_binder() -> None:
    """Serve's proxy binds its gRPC port with `bind` from now on."""
    from ray.serve._private import default_impl

    default_impl.add_grpc_address = bind
