"""The `ray-serve-llm` bench system's Serve LLM config: the disaggregated system's engines,
cores and NIXL connector, in the shape `build_pd_openai_app` takes. No Ray, no vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.systems import ALL_SYSTEMS, SYSTEMS, serve_llm_pool
from deploy.config import AppConfig
from kv_transfer.base import TransferSettings, make_backend
from tests.builders import make_settings


def pool(role: str = "producer", core: int = 0, **pools: object) -> dict[str, object]:
    config = AppConfig.model_validate({"topology": "disaggregated", **pools})
    name = "prefill" if role == "producer" else "decode"
    settings = make_settings(Path("/models/smol"), cpu_cores=(core,), served_model_name="smol")
    backend = make_backend(TransferSettings(backend="nixl", node_ip="127.0.0.1"))
    return serve_llm_pool(config, name, settings, backend, role)  # type: ignore[arg-type]


def test_not_in_the_default_set() -> None:
    assert "ray-serve-llm" in ALL_SYSTEMS
    assert "ray-serve-llm" not in SYSTEMS


def test_the_model_is_serve_llms_model_loading_config() -> None:
    llm = pool()
    assert llm["model_loading_config"] == {"model_id": "smol", "model_source": "/models/smol"}
    engine = llm["engine_kwargs"]
    assert isinstance(engine, dict)
    # Serve LLM refuses these two among the engine arguments.
    assert "model" not in engine and "served_model_name" not in engine
    assert engine["enforce_eager"] is True
    assert engine["block_size"] == 32
    assert engine["dtype"] == "float32"


@pytest.mark.parametrize(("role", "core"), [("producer", 0), ("consumer", 1)])
def test_each_pool_gets_pdserves_connector_and_its_core(role: str, core: int) -> None:
    llm = pool(role, core)
    engine = llm["engine_kwargs"]
    assert isinstance(engine, dict)
    assert engine["kv_transfer_config"] == {
        "kv_connector": "PdNixlConnector",
        "kv_connector_module_path": "kv_transfer.nixl_connector",
        "kv_role": f"kv_{role}",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "num_threads": 0,
            "kv_lease_duration": 60,
            "pd_transfer_timeout_s": 30.0,
        },
        "kv_buffer_device": "cpu",
    }
    env = llm["runtime_env"]["env_vars"]  # type: ignore[index]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo"
    assert llm["accelerator_config"] == {"kind": "cpu"}


def test_one_replica_per_pool() -> None:
    assert pool()["deployment_config"]["num_replicas"] == 1  # type: ignore[index]
    with pytest.raises(ValueError, match="one prefill replica"):
        pool(prefill={"num_replicas": 2, "max_replicas": 2})
