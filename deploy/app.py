"""`build_app(config) -> Application`: the Serve application graph of a pdserve config.

    disaggregated:  Router --prefill()--> Prefill pool
                           --decode()---> Decode pool
    colocated:      Router --generate()--> Engine pool
    auto:           one of those, as deploy/plan.py's planner picks it for `plan`'s workload

Also the import path of a Serve config (`import_path: deploy.app:build_app`, `args:` = the
AppConfig tree, validated by Serve against the annotation). Each pool is built by the same
helper; options come from the pool's config, so a YAML can resize a pool without code. Each
deployment is bound to its own frozen settings record (deploy/settings.py), never the config.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from autoscaling.serve_policy import autoscaling_config_for
from control.keys import REDIS_URL_ENV
from decode_workers.colocated import ColocatedServer
from decode_workers.deployment import DecodeServer, PrefillServer
from deploy.config import AppConfig, PoolName
from deploy.plan import resolve_auto
from deploy.settings import replica_settings, router_settings, transfer_settings
from kv_transfer.base import make_backend
from router.ingress import Router

logger = logging.getLogger(__name__)

DEPLOYMENT_NAMES: dict[PoolName, str] = {
    "prefill": "Prefill",
    "decode": "Decode",
    "engine": "Engine",
}
_SERVERS: dict[PoolName, type] = {
    "prefill": PrefillServer,
    "decode": DecodeServer,
    "engine": ColocatedServer,
}
_ROUTERS: dict[PoolName, str] = {
    "prefill": "router.replica_router.PrefillRequestRouter",
    "decode": "router.replica_router.DecodeRequestRouter",
    "engine": "router.replica_router.ColocatedRequestRouter",
}
# Engine processes inherit the replica's environment; these keep them quiet and single-purpose.
_ENGINE_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}

# Every replica on the token path runs our code and its handles' routing on the replica's own
# event loop. Serve's defaults give each a thread and a loop of its own, so every streamed item
# crosses threads twice (a thread-safe hand-off and a GIL switch each way): on the zero-time
# app, 64 streams, that cost 1.5 ms of CPU per token (docs/benchmarks.md, "The token path").
# Ray Serve's own throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED) sets the same two.
SERVE_LOOP_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


# The Router replicas hold the pools' handles. After our request router ranks the replicas,
# Serve probes the first one's queue length and, past a 0.1 s deadline, routes to the next rank:
# on a loaded machine that overrode prefix affinity and the decode choice (seen in a clean run:
# 16 calls sharing a prefix split over both prefill replicas). A slower probe is still an
# answer; a dead replica costs each call 1 s before the next rank is tried.
ROUTER_ENV = {
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2.0",
}


def deployment_options(config: AppConfig, pool: PoolName) -> dict[str, Any]:
    spec = config.pools[pool]
    # Every pool's request router may route prefill calls (role flips), by the prefix index.
    router_kwargs: dict[str, Any] = {
        "block_size": config.engine.block_size or 16,
        "prefix_ttl_s": config.router.prefix_ttl_s,
        "app_name": config.name,
    }
    # Serve's REST API returns request router kwargs, and the URL carries the password: when
    # it came from the environment, the request routers read the same variable (the Router
    # replica's process inherits its node's environment) instead of a kwarg.
    if _url_from_env(config):
        router_kwargs["redis_url_env"] = REDIS_URL_ENV
    else:
        router_kwargs["redis_url"] = config.control.redis_url
    env = _ENGINE_ENV | SERVE_LOOP_ENV
    return {
        "name": DEPLOYMENT_NAMES[pool],
        **_replica_count(config, pool),
        "max_ongoing_requests": spec.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
            **({"resources": dict(spec.resources)} if spec.resources else {}),
            "runtime_env": {"env_vars": env},
        },
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": spec.health_check_timeout_s,
        "graceful_shutdown_timeout_s": graceful_shutdown_s(config, pool),
        "request_router_config": RequestRouterConfig(
            request_router_class=_ROUTERS[pool],
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=config.router.stats_interval_s,
            request_routing_stats_timeout_s=max(5.0, 5 * config.router.stats_interval_s),
        ),
    }


# Serve's least wait for a stopping replica's calls before it is killed.
MIN_GRACEFUL_SHUTDOWN_S = 20.0


def graceful_shutdown_s(config: AppConfig, pool: PoolName) -> float:
    """How long Serve lets a replica chosen for removal drain (it gets no new calls meanwhile)
    before killing it; what is still running then moves to another replica (router/lifecycle.py).
    A stream may run to the largest max_tokens at the TPOT target, and no request outlives the
    router's `request_timeout_s`. A replica of the KV pools may also hold handoffs it prefilled
    (whichever pool it is in: a role flip gives it the other pool's calls), whose KV lives
    until pulled or until the lease ends: the lease, plus the least wait."""
    router = config.router
    longest_stream_s = router.max_tokens_limit * config.autoscaling.tpot_p95_s
    stream_s = max(MIN_GRACEFUL_SHUTDOWN_S, min(longest_stream_s, router.request_timeout_s))
    if pool == "engine":
        return stream_s
    return max(stream_s, config.kv_transfer.lease_seconds + MIN_GRACEFUL_SHUTDOWN_S)


def _replica_count(config: AppConfig, pool: PoolName) -> dict[str, Any]:
    """A fixed `num_replicas`, or our SLO policy for the pool (`autoscaling_config`)."""
    spec = config.pools[pool]
    if pool == "engine" or not config.autoscaling.enabled:
        return {"num_replicas": spec.num_replicas}
    # The Redis URL carries a password and Serve logs policy kwargs: when it came from the
    # environment, the policy reads the same variable (the Ray head's env) instead.
    from_env = _url_from_env(config)
    autoscaling = autoscaling_config_for(
        pool,
        config.name,
        None if from_env else config.control.redis_url,
        spec.min_replicas,
        spec.max_replicas,
        spec.num_replicas,
        slo=config.autoscaling.slo,
        config=config.autoscaling.policy_config(config.router.adaptive_itl_s),
        redis_url_env=REDIS_URL_ENV if from_env else None,
    )
    return {"autoscaling_config": autoscaling}


def _url_from_env(config: AppConfig) -> bool:
    """Whether the control plane's URL is the one in $PDSERVE_REDIS_URL (or none is set)."""
    url = config.control.redis_url
    return url is None or url == os.environ.get(REDIS_URL_ENV)


def with_env_redis_url(config: AppConfig) -> AppConfig:
    """`config` with the control plane's URL from $PDSERVE_REDIS_URL when it names none."""
    if config.control.redis_url is not None or not os.environ.get(REDIS_URL_ENV):
        return config
    control = config.control.model_copy(update={"redis_url": os.environ[REDIS_URL_ENV]})
    return config.model_copy(update={"control": control})


def _pool(config: AppConfig, pool: PoolName) -> Application:
    deployment = serve.deployment(_SERVERS[pool]).options(**deployment_options(config, pool))
    return deployment.bind(replica_settings(config, pool))


def build_app(args: AppConfig | dict[str, Any]) -> Application:
    """The app graph for `args`; nothing starts until `serve.run` / `serve deploy`. `serve
    deploy` (and KubeRay's serveConfigV2) hands the config's `args:` over as a dict: Serve
    validates into a pydantic model only when the annotation is the class itself, and under
    `from __future__ import annotations` it is a string, so the dict is validated here."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    config = with_env_redis_url(config)
    config, chosen = resolve_auto(config)
    if chosen is not None:
        logger.info("topology auto: %s", chosen.reason())
    router = serve.deployment(Router).options(
        name="Router",
        num_replicas=config.router.num_replicas,
        # Admission is the router's own (429 at once); Serve's cap only bounds what one replica
        # holds, and its proxy queue is bounded too (no unbounded wait in front of a full app).
        max_ongoing_requests=config.router.max_in_flight + config.router.refusal_room,
        max_queued_requests=config.router.max_queued_requests,
        ray_actor_options={
            "num_cpus": 0,
            **({"resources": dict(config.router.resources)} if config.router.resources else {}),
            "runtime_env": {"env_vars": ROUTER_ENV | SERVE_LOOP_ENV},
        },
    )
    if config.topology == "colocated":
        return router.bind(router_settings(config), _pool(config, "engine"))
    # Fails here, before any replica starts, when the backend's package is missing.
    idempotent = make_backend(transfer_settings(config)).release_is_idempotent
    return router.bind(
        router_settings(config, release_is_idempotent=idempotent),
        _pool(config, "prefill"),
        _pool(config, "decode"),
    )
