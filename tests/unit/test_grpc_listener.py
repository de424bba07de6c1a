"""api/grpc_listener.py and api/proxy_callback.py: what Serve's gRPC proxy binds and whether it
speaks TLS, from the environment. The binding itself is checked on a real grpc.aio server and
real sockets: a TLS listener on loopback answers a client that trusts its certificate, and
nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from api import grpc_listener
from api.client import _channel_credentials
from api.proxy_callback import install, proxy_env
from deploy.local import free_port
from tests.certs import self_signed
from tests.procs import listening_sockets


def test_listen_address_keeps_serves_port_on_the_host_asked() -> None:
    assert grpc_listener.listen_address("[::]:9000", {}) == "[::]:9000"
    env = {grpc_listener.HOST_ENV: "127.0.0.1"}
    assert grpc_listener.listen_address("[::]:9000", env) == "127.0.0.1:9000"
    ipv6 = {grpc_listener.HOST_ENV: "::1"}
    assert grpc_listener.listen_address("[::]:9000", ipv6) == "[::1]:9000"


def test_proxy_env_names_the_callback_and_only_what_was_asked() -> None:
    callback = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "api.proxy_callback.install"}
    assert proxy_env(None, None) == callback
    env = proxy_env("127.0.0.1", ("/c.pem", "/k.pem"), max_in_flight=20, app="pdserve")
    assert env == {
        **callback,
        grpc_listener.HOST_ENV: "127.0.0.1",
        grpc_listener.TLS_CERT_ENV: "/c.pem",
        grpc_listener.TLS_KEY_ENV: "/k.pem",
        "PDSERVE_PROXY_MAX_IN_FLIGHT": "20",
        "PDSERVE_PROXY_APP": "pdserve",
    }


def test_credentials_refuse_half_a_pair_and_name_an_unreadable_file(tmp_path: Path) -> None:
    assert grpc_listener.server_credentials({}) is None
    with pytest.raises(ValueError, match="go together"):
        grpc_listener.server_credentials({grpc_listener.TLS_CERT_ENV: "/c.pem"})
    cert, _ = self_signed(tmp_path)
    missing = {
        grpc_listener.TLS_CERT_ENV: str(cert),
        grpc_listener.TLS_KEY_ENV: str(tmp_path / "absent.pem"),
    }
    with pytest.raises(ValueError, match=f"{grpc_listener.TLS_KEY_ENV} .*absent.pem"):
        grpc_listener.server_credentials(missing)


def test_install_replaces_serves_binder_and_adds_the_gate_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray.serve._private import default_impl

    from api import proxy_gate

    original = default_impl.add_grpc_address
    try:
        monkeypatch.delenv(proxy_gate.MAX_IN_FLIGHT_ENV, raising=False)
        proxy_gate.proxy_gate.cache_clear()
        assert install() == []
        assert default_impl.add_grpc_address is grpc_listener.bind
        monkeypatch.setenv(proxy_gate.MAX_IN_FLIGHT_ENV, "3")
        proxy_gate.proxy_gate.cache_clear()
        [middleware] = install()
        assert middleware.cls is proxy_gate.HttpGate
        assert middleware.kwargs["gate"].capacity == 3
    finally:
        default_impl.add_grpc_address = original
        proxy_gate.proxy_gate.cache_clear()


async def _check(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def test_a_tls_listener_on_loopback_answers_only_a_client_that_trusts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    for name, value in proxy_env("127.0.0.1", (str(cert), str(key))).items():
        monkeypatch.setenv(name, value)
    port = free_port()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    grpc_listener.bind(server, f"[::]:{port}")  # what Serve's proxy asks for
    await server.start()
    try:
        assert listening_sockets([os.getpid()]) >= {("127.0.0.1", port)}
        assert [a for a, p in listening_sockets([os.getpid()]) if p == port] == ["127.0.0.1"]
        target = f"127.0.0.1:{port}"
        # The client side as the Python clients build it: roots from $PDSERVE_TLS_ROOTS.
        monkeypatch.setenv("PDSERVE_TLS_ROOTS", str(cert))
        trusting = _channel_credentials(None)
        assert trusting is not None
        assert await _check(target, trusting) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as untrusted:  # the system's roots only
            await _check(target, grpc.ssl_channel_credentials())
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await _check(target, None)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
