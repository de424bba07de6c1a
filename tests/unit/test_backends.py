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
