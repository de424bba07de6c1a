"""Every YAML under deploy/ parses, validates and builds into an app graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from control.keys import REDIS_URL_ENV
from deploy.app import (
    DEPLOYMENT_NAMES,
    build_app,
    deployment_options,
    graceful_shutdown_s,
    with_env_redis_url,
)
from deploy.config import AppConfig, load_app_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_CONFIGS = sorted((DEPLOY / "configs").glob("*.yaml"))


def _serve_config(raw: dict[str, Any]) -> AppConfig:
    """Validate as Serve does (`serve deploy`), then our args, then build the graph."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "deploy.app:build_app"
    assert app.route_prefix == "/"  # gRPC needs one
    servicers = schema.grpc_options.grpc_servicer_functions
    assert "api.serve_grpc.add_PDServeServicer_to_server" in servicers
    # Serve's own call of the builder, with the args as `serve deploy` sends them (a dict).
    graph = call_user_app_builder_with_args_if_necessary(build_app, app.args)
    assert type(graph).__name__ == "Application"
    return AppConfig.model_validate(app.args)


def test_every_config_is_covered() -> None:
    assert {p.name for p in SERVE_CONFIGS} == {"local.yaml", "gpu-cluster.yaml", "sim-scale.yaml"}


def test_sim_scale_config_is_16_sim_replicas_and_2_routers() -> None:
    config = load_app_config(DEPLOY / "configs" / "sim-scale.yaml")
    assert config.engine.sim is not None and config.kv_transfer.backend == "sim"
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (8, 8)
    assert config.router.num_replicas == 2 and config.prefill.num_cpus == 0


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_validate_and_build(path: Path) -> None:
    config = _serve_config(yaml.safe_load(path.read_text()))
    assert load_app_config(path) == config


def test_local_config_is_the_embedded_default() -> None:
    config = load_app_config(DEPLOY / "configs" / "local.yaml")
    assert config.topology == "disaggregated" and config.engine.model == "default"
    assert config.engine.device == "cpu" and config.engine.dtype == "float32"
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (1, 1)
    assert (config.prefill.cpu_cores, config.decode.cpu_cores) == ([0], [1])


def test_gpu_config_uses_gpus() -> None:
    config = load_app_config(DEPLOY / "configs" / "gpu-cluster.yaml")
    assert config.engine.device == "cuda"
    for pool in ("prefill", "decode"):
        options = deployment_options(config, pool)  # type: ignore[arg-type]
        assert options["ray_actor_options"]["num_gpus"] == 1
        assert options["name"] == DEPLOYMENT_NAMES[pool]  # type: ignore[index]


def test_kuberay_rayservice_embeds_a_valid_serve_config() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service", "PersistentVolumeClaim", "RayService"}
    service = kinds["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    config = _serve_config(yaml.safe_load(service["spec"]["serveConfigV2"]))
    assert config.engine.device == "cuda"
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert groups[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    # The control plane's password reaches the pods from the Secret, never a literal.
    for doc in docs:
        assert "redis://" not in yaml.safe_dump(doc)


def test_kuberay_pods_mount_the_model_run_one_image_and_scale_with_the_pools() -> None:
    """Every pod that reads the model (head: Router replicas load its tokenizer; workers: the
    engines) mounts the declared claim where the config's model path lies; every Ray container
    runs the pdserve image (Serve's proxies import api.serve_grpc from the node, not from an
    app's runtime_env); the worker group's bounds are the GPU pools' together, and Ray's
    autoscaler is on."""
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    claim = kinds["PersistentVolumeClaim"]["metadata"]["name"]
    service = kinds["RayService"]["spec"]
    config = _serve_config(yaml.safe_load(service["serveConfigV2"]))
    serve_config = yaml.safe_load(service["serveConfigV2"])
    assert "runtime_env" not in serve_config["applications"][0]
    cluster = service["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        assert container["image"].endswith("/pdserve:0.1.0"), container["image"]
        mounts = [m for m in container["volumeMounts"] if m["name"] in volumes]
        assert any(
            volumes[m["name"]]["persistentVolumeClaim"]["claimName"] == claim
            and config.engine.model.startswith(m["mountPath"] + "/")
            for m in mounts
        ), container["name"]
    (group,) = cluster["workerGroupSpecs"]
    gpu_pools = [config.prefill, config.decode]
    assert group["minReplicas"] == sum(p.min_replicas * p.num_gpus for p in gpu_pools)
    assert group["maxReplicas"] == sum(p.max_replicas * p.num_gpus for p in gpu_pools)
    dockerfile = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray-llm:{cluster['rayVersion']}-" in dockerfile
    assert "pip install --no-cache-dir --no-deps -e /home/ray/pdserve" in dockerfile


def test_cluster_launcher_yaml_passes_rays_schema() -> None:
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    config = yaml.safe_load((DEPLOY / "cluster" / "ray-cluster.yaml").read_text())
    # What `ray up` does: defaults for the provider, then the JSON schema (raises on a violation).
    validate_config(fillout_defaults(config))
    deploy_cmd = " ".join(config["head_start_ray_commands"])
    assert "serve deploy deploy/configs/gpu-cluster.yaml" in deploy_cmd


def test_cluster_launcher_runs_every_ray_process_with_token_auth_and_no_open_dashboard() -> None:
    """Every `ray start` (head and workers) and `serve deploy` carries token auth with the
    mounted token (a node without it cannot join), and the dashboard stays on loopback."""
    config = yaml.safe_load((DEPLOY / "cluster" / "ray-cluster.yaml").read_text())
    token = "~/.pdserve-ray-token"
    assert config["file_mounts"][token] == "~/.pdserve/ray-token"
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    ray_commands = [c for c in commands if "ray start" in c or "serve deploy" in c]
    assert len(ray_commands) == 3
    for command in ray_commands:
        assert "RAY_AUTH_MODE=token" in command, command
        assert "RAY_AUTH_TOKEN_PATH=$HOME/.pdserve-ray-token" in command, command
    head = next(c for c in commands if "ray start --head" in c)
    assert "--dashboard-host=127.0.0.1" in head
    assert all("0.0.0.0" not in c for c in ray_commands)


def test_cluster_launcher_pins_pdserve_and_puts_the_model_on_every_node() -> None:
    """What tests/e2e/test_launcher_topology.py cannot run here (setup_commands): pdserve at the
    release tag of this version, the model in the folder the Serve config loads, and the apt
    redis-server's own service off (it would hold 6379, the GCS port)."""
    import tomllib

    config = yaml.safe_load((DEPLOY / "cluster" / "ray-cluster.yaml").read_text())
    setup = config["setup_commands"]
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    clone = next(c for c in setup if "git clone" in c)
    assert f"--branch v{version} " in clone, clone
    model = load_app_config(DEPLOY / "configs" / "gpu-cluster.yaml").engine.model
    assert any("hf download" in c and f"--local-dir {model}" in c for c in setup), setup
    assert any("systemctl disable --now redis-server" in c for c in setup), setup
    head = " ".join(config["head_start_ray_commands"])
    assert "port 6380" in head and "--port=6379" in head


def test_a_stopping_replica_drains_for_its_leases_or_its_longest_stream() -> None:
    config = AppConfig.model_validate(
        {
            "kv_transfer": {"lease_seconds": 45},
            "router": {"max_tokens_limit": 1000},
            "autoscaling": {"tpot_p95_s": 0.3},
        }
    )
    # Either KV pool's replica may be streaming (a role flip) or hold leases: the longer.
    assert graceful_shutdown_s(config, "prefill") == pytest.approx(300)
    assert graceful_shutdown_s(config, "decode") == pytest.approx(300)
    short_streams = config.model_copy(
        update={"router": config.router.model_copy(update={"max_tokens_limit": 100})}
    )
    assert graceful_shutdown_s(short_streams, "prefill") == 45 + 20
    assert graceful_shutdown_s(short_streams, "decode") == 45 + 20
    assert graceful_shutdown_s(short_streams, "engine") == pytest.approx(30)
    assert deployment_options(config, "decode")["graceful_shutdown_timeout_s"] == pytest.approx(300)
    loose = config.model_copy(
        update={"autoscaling": config.autoscaling.model_copy(update={"tpot_p95_s": 5.0})}
    )
    assert graceful_shutdown_s(loose, "decode") == 600  # router.request_timeout_s
    short = AppConfig.model_validate({"router": {"max_tokens_limit": 10, "default_max_tokens": 10}})
    assert graceful_shutdown_s(short, "engine") == 20  # never under Serve's usual wait


def test_colocated_builds_one_engine_pool() -> None:
    config = AppConfig(topology="colocated")
    assert list(config.pools) == ["engine"]
    assert type(build_app(config)).__name__ == "Application"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"topology": "pipeline"}, "topology"),
        ({"prefill": {"num_replicas": 5, "max_replicas": 4}}, "num_replicas"),
        ({"engine": {"max_model_len": 4}}, "max_model_len"),
        ({"kv_transfer": {"backend": "carrier-pigeon"}}, "backend"),
        ({"router": {"default_max_tokens": 9000}}, "default_max_tokens"),
        ({"engine": {"device": "cpu", "block_size": 16}}, "block_size"),
        ({"name": "bad name!"}, "name"),
        ({"unknown_section": {}}, "unknown_section"),
        (
            {"decode": {"engine_kwargs": {"max_num_batched_token": 512}}},
            "decode.engine_kwargs.max_num_batched_token: not an argument of vLLM's EngineArgs",
        ),
        (
            {"engine": {"engine_kwargs": {"block_size": 64}}},
            "engine.engine_kwargs.block_size: set engine.block_size instead",
        ),
        (
            {"engine": {"engine_kwargs": {"stream_interval": 4}}},
            "engine.engine_kwargs.stream_interval: set engine.stream_interval instead",
        ),
        ({"engine": {"stream_interval": 0}}, "stream_interval"),
        (
            {
                "kv_transfer": {"backend": "ray"},
                "engine": {"engine_kwargs": {"tensor_parallel_size": 2}},
            },
            "the ray backend moves one worker's KV",
        ),
        (
            {"prefill": {"num_gpus": 1}, "engine": {"engine_kwargs": {"tensor_parallel_size": 4}}},
            "prefill.num_gpus: 1, but its engines run tensor_parallel_size 4",
        ),
    ],
)
def test_bad_configs_are_refused_with_the_field(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(patch)
    assert message in str(info.value)


def test_the_router_refuses_past_admission_and_serves_proxy_queue_is_bounded() -> None:
    """Serve's proxy queues calls past a replica's max_ongoing_requests (unbounded by default):
    a burst would wait there instead of meeting the router's own 429. The router takes
    max_in_flight + refusal_room, and the proxy holds at most max_queued_requests more."""
    config = load_app_config(DEPLOY / "configs" / "local.yaml")
    router = build_app(config)._bound_deployment
    assert router.name == "Router"
    assert router.max_ongoing_requests == config.router.max_in_flight + config.router.refusal_room
    assert router.max_queued_requests == config.router.max_queued_requests > 0
    # Serve's queue-length probe waits long enough not to override our routing choice.
    env = router.ray_actor_options["runtime_env"]["env_vars"]
    assert float(env["RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S"]) >= 1.0


def test_a_redis_url_from_the_environment_is_no_request_router_kwarg(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve's REST API returns each deployment's request router kwargs: a URL that came from
    $PDSERVE_REDIS_URL (what `pdserve up` and the cluster recipes do) is passed by the variable's
    name; one written into the config is passed as it is (operations.md says to prefer the env)."""
    url = "redis://:s3cret-pw@10.0.0.5:6380/0"
    monkeypatch.setenv(REDIS_URL_ENV, url)
    config = with_env_redis_url(load_app_config(DEPLOY / "configs" / "local.yaml"))
    assert config.control.redis_url == url
    for pool in ("prefill", "decode"):
        options = deployment_options(config, pool)  # type: ignore[arg-type]
        assert "s3cret-pw" not in repr(options), pool  # request router and policy kwargs
    prefill = deployment_options(config, "prefill")["request_router_config"]
    assert prefill.request_router_kwargs["redis_url_env"] == REDIS_URL_ENV
    assert prefill.request_router_kwargs["app_name"] == config.name
    monkeypatch.delenv(REDIS_URL_ENV)
    prefill = deployment_options(config, "prefill")["request_router_config"]
    assert prefill.request_router_kwargs["redis_url"] == url


def test_engine_kwargs_reach_each_pools_engine_args() -> None:
    """The app's engine_kwargs, a pool's own over them, end in the EngineArgs vLLM is given."""
    from deploy.settings import engine_spec

    config = AppConfig.model_validate(
        {
            "engine": {"device": "cpu", "engine_kwargs": {"max_num_batched_tokens": 512}},
            "decode": {
                "engine_kwargs": {"max_num_batched_tokens": 1024, "enable_prefix_caching": False}
            },
        }
    )
    prefill = engine_spec(config, "prefill").resolve().vllm_kwargs()
    decode = engine_spec(config, "decode").resolve().vllm_kwargs()
    assert prefill["max_num_batched_tokens"] == 512 and "enable_prefix_caching" not in prefill
    assert (decode["max_num_batched_tokens"], decode["enable_prefix_caching"]) == (1024, False)
    args = engine_spec(config, "decode").resolve().async_engine_args()
    assert (args.max_num_batched_tokens, args.enable_prefix_caching) == (1024, False)


def test_each_pools_health_checks_are_its_own() -> None:
    """Serve's health-check period and timeout per pool: 10 s and 60 s unless set."""
    config = AppConfig.model_validate({"decode": {"health_check_period_s": 2}})
    decode = deployment_options(config, "decode")
    prefill = deployment_options(config, "prefill")
    assert (decode["health_check_period_s"], decode["health_check_timeout_s"]) == (2, 60)
    assert (prefill["health_check_period_s"], prefill["health_check_timeout_s"]) == (10, 60)
    with pytest.raises(ValidationError, match="health_check_period_s"):
        AppConfig.model_validate({"prefill": {"health_check_period_s": 0}})
