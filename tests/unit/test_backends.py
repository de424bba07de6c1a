from __future__ import annotations

import pytest

from engine.messages import NixlPull, RayPull
from kv_transfer.base import TransferSettings, backend_names, make_backend


def test_builtin_backends_are_registered() -> None:
    assert {"nixl", "ray"} <= set(backend_names())


def test_unknown_backend_is_an_error_at_startup() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend 'carrier-pigeon'"):
        make_backend(TransferSettings(backend="carrier-pigeon"))


def test_missing_package_is_an_error_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install nixl"):
        make_backend(TransferSettings(backend="nixl"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"failure_policy": "ignore"}, "failure_policy"), ({"lease_seconds": 0}, "lease_seconds")],
)
def test_bad_transfer_settings(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferSettings(**fields)  # type: ignore[arg-type]


def test_backends_refuse_each_others_pulls() -> None:
    nixl = make_backend(TransferSettings(backend="nixl"))
    ray = make_backend(TransferSettings(backend="ray", ray_address="127.0.0.1:1"))
    with pytest.raises(TypeError):
        nixl.consumer_request_params(RayPull.from_producer_params({"key": "k"}))
    pull = NixlPull("e", "r", "h", 1, ((1,),), 32)
    with pytest.raises(TypeError):
        ray.consumer_request_params(pull)


def test_nixl_engines_get_distinct_ports() -> None:
    nixl = make_backend(TransferSettings(backend="nixl"))
    ports = {nixl.process_env()["VLLM_NIXL_SIDE_CHANNEL_PORT"] for _ in range(5)}
    assert len(ports) > 1


def test_engines_listen_where_the_settings_say() -> None:
    """A node's address (what other hosts reach) by default; loopback when `listen_host` says
    so (`pdserve up`), and then UCX's TCP transport too stays off the network devices."""
    node = "10.1.2.3"  # never bound: the nixl port is given, so none is probed
    for backend in ("nixl", "ray"):
        extra = {"ray_address": "127.0.0.1:1"} if backend == "ray" else {"nixl_port": 5600}
        on_node = make_backend(TransferSettings(backend=backend, node_ip=node, **extra))
        assert on_node.process_env()["VLLM_HOST_IP"] == node
        assert "UCX_NET_DEVICES" not in on_node.process_env()
        local = make_backend(
            TransferSettings(backend=backend, node_ip=node, listen_host="127.0.0.1", **extra)
        )
        assert local.process_env()["VLLM_HOST_IP"] == "127.0.0.1"
    nixl_env = make_backend(
        TransferSettings(backend="nixl", node_ip=node, listen_host="127.0.0.1", nixl_port=5600)
    ).process_env()
    assert nixl_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert nixl_env["UCX_NET_DEVICES"] == "lo"
    on_node_env = make_backend(
        TransferSettings(backend="nixl", node_ip=node, nixl_port=5600)
    ).process_env()
    assert on_node_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == node
