"""`build_app` hands each deployment its own frozen, picklable settings record, never the
config tree, and the records carry what the config says."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest

from control.store import LoadPublisher
from deploy.app import build_app
from deploy.config import AppConfig
from deploy.settings import replica_settings, router_settings
from engine.settings import EngineSpec
from prefill_workers.replica import ReplicaSettings
from router.admission import AdmissionLimits
from router.ingress import RouterSettings

URL = "redis://:secret-password@127.0.0.1:6390/0"


def make_config(**overrides: Any) -> AppConfig:
    base: dict[str, Any] = {
        "name": "demo",
        "engine": {"model": "tiny", "device": "cpu", "max_model_len": 1024},
        "prefill": {"cpu_cores": [0]},
        "decode": {"cpu_cores": [1]},
        "kv_transfer": {"backend": "ray", "lease_seconds": 30},
        "autoscaling": {"window_s": 20, "percentile": 90},
    }
    return AppConfig.model_validate(base | overrides)


def test_each_pool_gets_its_engine_cores_transfer_and_window() -> None:
    config = make_config()
    prefill, decode = replica_settings(config, "prefill"), replica_settings(config, "decode")
    assert prefill.engine == EngineSpec(
        model="tiny", device="cpu", max_model_len=1024, cpu_cores=(0,), core_group="demo.prefill"
    )
    assert decode.engine.cpu_cores == (1,)
    assert prefill.transfer == decode.transfer
    assert prefill.transfer is not None and prefill.transfer.backend == "ray"
    assert prefill.transfer.lease_registry == "pdserve-kv-leases-demo"
    assert prefill.transfer.ray_address is None  # each replica joins its own cluster
    assert (prefill.window_s, prefill.percentile) == (20.0, 90.0)
    assert prefill.status is None  # no control plane configured


def test_the_colocated_engine_moves_no_kv_and_publishes_no_status() -> None:
    config = make_config(topology="colocated", control={"redis_url": URL})
    engine = replica_settings(config, "engine")
    assert engine.transfer is None and engine.status is None
    with pytest.raises(ValueError, match="needs transfer settings"):
        engine.require_transfer()


def test_scaled_pools_publish_their_load_without_showing_the_password() -> None:
    settings = replica_settings(make_config(control={"redis_url": URL}), "decode")
    assert isinstance(settings.status, LoadPublisher)
    assert "secret-password" not in repr(settings)
    copy = pickle.loads(pickle.dumps(settings))
    assert isinstance(copy.status, LoadPublisher)
    assert (copy.status.url, copy.status.app) == (URL, "demo")


def test_router_settings() -> None:
    config = make_config(
        router={"max_in_flight": 8, "max_queued_prompt_tokens": 4096, "max_tokens_limit": 512},
        control={"redis_url": URL},
    )
    settings = router_settings(config, release_is_idempotent=True)
    assert settings == RouterSettings(
        app="demo",
        model="tiny",
        served_name=None,
        max_model_len=1024,
        max_tokens_limit=512,
        default_max_tokens=256,
        admission=AdmissionLimits(8, 4096),
        colocated=False,
        release_is_idempotent=True,
        control_url=URL,
    )
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert router_settings(make_config(topology="colocated")).colocated


def test_adaptive_prefill_keeps_the_tpot_slo_and_excludes_the_threshold() -> None:
    adaptive = make_config(
        router={"adaptive_prefill": True},
        autoscaling={"window_s": 20, "percentile": 90, "tpot_p95_s": 0.15},
    )
    assert router_settings(adaptive).adaptive_prefill_tpot_s == 0.15
    assert router_settings(make_config()).adaptive_prefill_tpot_s is None
    with pytest.raises(ValueError, match=r"router.adaptive_prefill and router.local_prefill_max"):
        make_config(router={"adaptive_prefill": True, "local_prefill_max_tokens": 64})
    itl = make_config(
        router={"adaptive_prefill": True, "adaptive_stall_budget": "token", "adaptive_itl_s": 0.05}
    )
    assert (router_settings(itl).adaptive_stall_budget, router_settings(itl).adaptive_itl_s) == (
        "token",
        0.05,
    )
    with pytest.raises(ValueError, match=r"router.adaptive_itl_s .*adaptive_stall_budget: token"):
        make_config(router={"adaptive_prefill": True, "adaptive_itl_s": 0.05})
    # A split that may lend every prefill engine needs the router that then prefills locally.
    none = {"window_s": 20, "percentile": 90, "split_min_prefill_engines": 0}
    lendable = make_config(router={"adaptive_prefill": True}, autoscaling=none)
    assert lendable.autoscaling.policy_config().split_min_prefill_engines == 0
    # A local prompt's stall is bounded by the router's ITL SLO where it has one.
    assert lendable.autoscaling.policy_config().split_stall_limit_s is None
    assert lendable.autoscaling.policy_config(0.05).split_stall_limit_s == 0.05
    from deploy.app import deployment_options

    itl_router = {
        "adaptive_prefill": True,
        "adaptive_stall_budget": "token",
        "adaptive_itl_s": 0.05,
    }
    for router, limit in (({"adaptive_prefill": True}, None), (itl_router, 0.05)):
        app = make_config(router=router, autoscaling=none | {"enabled": True})
        options = deployment_options(app, "decode")["autoscaling_config"]
        assert options["policy"]["policy_kwargs"]["config"]["split_stall_limit_s"] == limit
    assert make_config().autoscaling.policy_config().split_min_prefill_engines == 1
    with pytest.raises(ValueError, match=r"split_min_prefill_engines: 0 .*adaptive_prefill"):
        make_config(autoscaling=none)
    with pytest.raises(ValueError, match=r"split_min_prefill_engines"):
        make_config(
            router={"adaptive_prefill": True}, autoscaling=none | {"split_min_prefill_engines": 2}
        )


@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_every_deployment_is_bound_to_a_settings_record(topology: str) -> None:
    config = make_config(topology=topology)
    router = build_app(config)._bound_deployment
    settings, *pools = router.init_args
    assert isinstance(settings, RouterSettings)
    assert settings.release_is_idempotent is (topology == "disaggregated")  # the ray backend
    for pool in pools:
        (pool_settings,) = pool._bound_deployment.init_args
        assert isinstance(pool_settings, ReplicaSettings)
        assert pickle.loads(pickle.dumps(pool_settings)) == pool_settings
    assert len(pools) == (1 if topology == "colocated" else 2)


def test_engine_spec_resolves_a_folder_on_the_serving_node(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    spec = EngineSpec(model=str(tmp_path), device="cpu", cpu_cores=(3,), max_model_len=512)
    settings = spec.resolve()
    assert settings.model == tmp_path.resolve() and settings.cpu_cores == (3,)
    gpu = EngineSpec(model=str(tmp_path), device="cuda", block_size=None, cpu_cores=(3,))
    resolved = gpu.resolve()
    assert resolved.cpu_cores is None and resolved.kv_cache_memory_bytes is None
    # Two replicas of a pool with a core each (engine/cores.py): each resolves to its own.
    sliced = EngineSpec(
        model=str(tmp_path),
        device="cpu",
        cpu_cores=(0, 1),
        cores_per_replica=1,
        core_group=f"test-{uuid.uuid4().hex}.decode",
    )
    assert {sliced.resolve().cpu_cores, sliced.resolve().cpu_cores} == {(0,), (1,)}
