"""The systems a benchmark compares, each started for its turn and stopped after it, so they
never share the cores:

- `disaggregated`: `pdserve up` (its own Ray head, Redis, Serve app), prefill and decode pools;
- `colocated`: the same, with one engine pool serving both phases;
- `engine`: vLLM's AsyncLLM in this process, with the prefill pool's engine settings and cores;
- `sim`: the disaggregated app with simulated engines (engine/sim/): the config's `engine.sim`,
  else the named profile. Not in the default set: it measures pdserve, not an engine.

Autoscaling is off in a benchmark: the pools keep the sizes the config gives, so the three
systems run on the same cores throughout. Ports are free ones, and the run state lives in a
private PDSERVE_RUN_DIR, so a `pdserve up` already running is left alone.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from bench.targets import EngineTarget, GrpcTarget, Target
from deploy.config import AppConfig, with_sim_engine

SystemName = Literal["disaggregated", "colocated", "engine", "sim"]
SYSTEMS: tuple[SystemName, ...] = ("disaggregated", "colocated", "engine")
ALL_SYSTEMS: tuple[SystemName, ...] = (*SYSTEMS, "sim")
DEFAULT_SIM_PROFILE = "cpu-smollm2"


def bench_config(
    config: AppConfig, system: SystemName, sim_profile: str = DEFAULT_SIM_PROFILE
) -> AppConfig:
    data = config.model_dump()
    data["autoscaling"]["enabled"] = False
    if system == "sim":
        if data["engine"]["sim"] is None:
            data = with_sim_engine(data, sim_profile)
        data["topology"] = "disaggregated"
    elif system != "engine":
        data["topology"] = system
    return AppConfig.model_validate(data)


@contextmanager
def start_system(
    system: SystemName,
    config: AppConfig,
    timeout_s: float = 900,
    sim_profile: str = DEFAULT_SIM_PROFILE,
) -> Iterator[Target]:
    if system == "engine":
        with _bare_engine(config) as target:
            yield target
    else:
        with _pdserve(system, bench_config(config, system, sim_profile), timeout_s) as target:
            yield target


@contextmanager
def _pdserve(system: SystemName, config: AppConfig, timeout_s: float) -> Iterator[Target]:
    from deploy.local import free_port
    from deploy.up import down, up

    previous = os.environ.get("PDSERVE_RUN_DIR")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as run_dir:
        os.environ["PDSERVE_RUN_DIR"] = run_dir
        try:
            run = up(config, http_port=free_port(), grpc_port=free_port(), timeout_s=timeout_s)
            try:
                # `up` makes the run an API key (auth is on by default): the client sends it.
                yield GrpcTarget(
                    system, run.grpc_target, application=config.name, api_key=run.api_key or None
                )
            finally:
                report = down()
                if report is not None and report.leftovers:
                    raise RuntimeError(f"{system}: processes left running: {report.leftovers}")
        finally:
            if previous is None:
                os.environ.pop("PDSERVE_RUN_DIR", None)
            else:
                os.environ["PDSERVE_RUN_DIR"] = previous


@contextmanager
def _bare_engine(config: AppConfig) -> Iterator[Target]:
    from deploy.settings import engine_spec
    from engine.async_engine import start_async_engine

    saved = dict(os.environ)
    try:
        engine, _ = start_async_engine(engine_spec(config, "prefill").resolve())
    finally:  # The engine's processes have their environment; this one gets its own back.
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield EngineTarget("engine", engine)
    finally:
        engine.shutdown()
        # Collected now: AsyncLLM's __del__ shuts down again, which fails at interpreter exit.
        del engine
        gc.collect()
