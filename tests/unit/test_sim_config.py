"""Sim engines in the config tree: `engine.sim`, the `sim` backend, and what reaches a replica."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bench.systems import bench_config
from deploy.config import AppConfig, with_sim_engine
from deploy.settings import replica_settings
from engine.settings import SimSpec


def sim_app(**overrides: object) -> AppConfig:
    data = with_sim_engine(AppConfig().model_dump(), "h100-llama2-7b", "nvlink", 30.0)
    return AppConfig.model_validate({**data, **overrides})


def test_with_sim_engine_sets_profile_backend_and_frees_the_pools() -> None:
    config = sim_app()
    assert config.engine.sim is not None and config.kv_transfer.backend == "sim"
    assert config.prefill.num_cpus == 0 and config.decode.cpu_cores is None
    spec = replica_settings(config, "decode").engine
    assert spec.sim == SimSpec("h100-llama2-7b", "nvlink", 30.0)
    assert spec.resolve().sim == spec.sim


def test_sim_engine_and_sim_backend_go_together() -> None:
    data = sim_app().model_dump()
    data["kv_transfer"]["backend"] = "nixl"
    with pytest.raises(ValidationError, match="go together"):
        AppConfig.model_validate(data)
    with pytest.raises(ValidationError, match="go together"):
        AppConfig.model_validate({"kv_transfer": {"backend": "sim"}})


@pytest.mark.parametrize(
    ("sim", "message"),
    [
        ({"profile": "a100-imaginary"}, "unknown sim profile"),
        ({"link": "smoke"}, "unknown sim link"),
    ],
)
def test_unknown_profiles_and_links_are_refused_at_the_edge(
    sim: dict[str, str], message: str
) -> None:
    data = sim_app().model_dump()
    data["engine"]["sim"] = {**data["engine"]["sim"], **sim}
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(data)


def test_the_bench_sim_system_is_the_disaggregated_app_on_sim_engines() -> None:
    config = bench_config(AppConfig(topology="colocated"), "sim", sim_profile="zero")
    assert config.topology == "disaggregated" and not config.autoscaling.enabled
    assert config.engine.sim is not None and config.engine.sim.profile == "zero"
    # A config that already names a sim engine keeps it.
    assert bench_config(sim_app(), "sim").engine.sim == sim_app().engine.sim


def test_the_bench_adaptive_system_is_the_disaggregated_app_deciding_per_request() -> None:
    base = AppConfig.model_validate(
        {"topology": "colocated", "router": {"local_prefill_max_tokens": 256}}
    )
    config = bench_config(base, "adaptive")
    assert config.topology == "disaggregated" and not config.autoscaling.enabled
    assert config.router.adaptive_prefill and config.router.local_prefill_max_tokens == 0
    assert bench_config(base, "disaggregated").router.adaptive_prefill is False


def test_pdserve_up_takes_engine_and_profile() -> None:
    from deploy.cli import build_parser

    args = build_parser().parse_args(["up", "--engine", "sim", "--profile", "zero"])
    assert (args.engine, args.profile, args.sim_link, args.start_delay) == ("sim", "zero", None, 0)
