"""End-to-end fixtures: real servers started once per session."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from api.client import AsyncPDServeClient, PDServeClient
from control.redis_server import RedisServer, start_redis_server
from control.store import ControlStore
from deploy.config import AppConfig
from engine.stats import KVLoadCounts
from tests.hosts import Hosts

# --- Order -------------------------------------------------------------------------------

# Run first in this package, before `serve_apps` starts its five engines: the module's own apps
# run the default model on four engines each, and both sets together do not fit in this
# machine's 24 GiB (in a full run Ray's memory monitor killed replicas of both).
FIRST_MODULES = ("test_routing.py",)


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by fixture scope and parameter
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    first = [i for i in items if i.path.parent == here and i.path.name in FIRST_MODULES]
    if not first:
        return
    moved = {id(i) for i in first}
    rest = [i for i in items if id(i) not in moved]
    at = next((k for k, i in enumerate(rest) if i.path.parent == here), len(rest))
    items[:] = rest[:at] + first + rest[at:]


# --- Redis control plane (control/) -------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory, hosts: Hosts) -> Iterator[RedisServer]:
    """A private redis-server (random password) shared by the whole session, on host a's
    address: replicas on the other hosts reach it there, as they would across machines."""
    server = start_redis_server(tmp_path_factory.mktemp("redis"), host=hosts.ip("a"))
    yield server
    server.stop()


@pytest.fixture
async def control_store(redis_server: RedisServer) -> AsyncIterator[ControlStore]:
    """A store under a fresh app name, so tests sharing the server never see each other."""
    store = await ControlStore.connect(redis_server.url, f"test-{uuid.uuid4().hex[:12]}")
    yield store
    await store.close()


# --- end of Redis control plane fixtures ---------------------------------------------------

# --- The Serve apps (router + pools) on the session's Ray cluster --------------------------

APP_TIMEOUT_S = 900
# The deadline of each call of `ServedApp.client()` / `aclient()`: the calls here take seconds;
# a wedged app fails in two minutes, not five.
CALL_TIMEOUT_S = 120


@dataclass(frozen=True)
class ServedApp:
    """One pdserve app deployed on the test cluster's Serve, reachable over real sockets."""

    key: str
    config: AppConfig
    grpc_target: str
    http_port: int
    # The app's API key (router.api_keys_file holds its hash); None: the app takes no keys.
    api_key: str | None = None
    # More keys of the same file, by name, each with limits (LIMITED_KEYS).
    limited_keys: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def openai_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/{self.name}/v1"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata of a raw call: the application, and the key when the app takes one."""
        auth = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return (("application", self.name), *auth)

    @property
    def http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> PDServeClient:
        return PDServeClient(
            self.grpc_target, application=self.name, timeout_s=CALL_TIMEOUT_S, api_key=self.api_key
        )

    def aclient(self) -> AsyncPDServeClient:
        return AsyncPDServeClient(
            self.grpc_target, application=self.name, timeout_s=CALL_TIMEOUT_S, api_key=self.api_key
        )

    def router_in_flight(self) -> int:
        """The requests the app's (one) router holds now, as its /health counts them."""
        import json
        import urllib.request

        url = f"http://127.0.0.1:{self.http_port}/{self.name}/health"
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(json.loads(response.read())["in_flight"])

    def wait_router_idle(self, timeout_s: float = 60) -> None:
        """Until the router holds no request (a cancel reaches it after the client is gone).
        Fails after `timeout_s`: a slot never given back is a leak."""
        deadline = time.monotonic() + timeout_s
        while (in_flight := self.router_in_flight()) != 0:
            assert time.monotonic() < deadline, f"{in_flight} requests still in flight"
            time.sleep(0.5)

    @property
    def engine_deployments(self) -> tuple[str, ...]:
        return ("Engine",) if self.config.topology == "colocated" else ("Prefill", "Decode")

    async def engines_idle(self) -> dict[str, bool]:
        """Each engine pool's strict no-KV-blocks check (one replica per pool here)."""
        from ray import serve

        return {
            name: bool(await serve.get_deployment_handle(name, self.name).is_idle.remote())
            for name in self.engine_deployments
        }

    @property
    def is_disaggregated(self) -> bool:
        return self.config.topology == "disaggregated"

    def kv_loads(self) -> KVLoadCounts:
        """What the decode replica's KV loads came to so far (one replica per pool here)."""
        from ray import serve

        handle = serve.get_deployment_handle("Decode", self.name)
        loads: KVLoadCounts = handle.kv_loads.remote().result(timeout_s=60)
        return loads

    async def akv_loads(self) -> KVLoadCounts:
        from ray import serve

        loads: KVLoadCounts = await serve.get_deployment_handle(
            "Decode", self.name
        ).kv_loads.remote()
        return loads

    @contextmanager
    def expect_kv_loaded(self, num_requests: int) -> Iterator[None]:
        """The block's requests each loaded their prompt's KV on the decode replica: decode
        computed at most each prompt's last token, and no load failed (colocated: nothing)."""
        if not self.is_disaggregated:
            yield
            return
        before = self.kv_loads()
        yield
        got = self.kv_loads().minus(before)
        assert got == KVLoadCounts(num_loads=num_requests), got

    async def diagnose(self, timeout_s: float = 30) -> dict[str, str]:
        """What each engine replica answers (bounded: a replica that does not answer within
        `timeout_s` says so), for the message of a test that timed out."""
        from ray import serve

        async def ask(deployment: str, method: str) -> str:
            handle = serve.get_deployment_handle(deployment, self.name)
            try:
                return repr(await asyncio.wait_for(getattr(handle, method).remote(), timeout_s))
            except TimeoutError:
                return f"no answer in {timeout_s:.0f} s"
            except Exception as exc:
                return f"failed: {exc!r}"[:300]

        asks = {f"{name}.is_idle": ask(name, "is_idle") for name in self.engine_deployments}
        if self.is_disaggregated:
            asks["Decode.kv_loads"] = ask("Decode", "kv_loads")
        answers = await asyncio.gather(*asks.values())
        return dict(zip(asks, answers, strict=True))

    async def wait_engines_idle(self, timeout_s: float = 60) -> dict[str, bool]:
        deadline = time.monotonic() + timeout_s
        while True:
            idle = await self.engines_idle()
            if all(idle.values()) or time.monotonic() > deadline:
                return idle
            await asyncio.sleep(0.5)


def on_host(host: str) -> dict[str, float]:
    """Ray resources that place a replica on `host` (tests/hosts.py)."""
    return {f"host_{host}": 0.01}


def _app_configs(redis_url: str, api_keys_file: str) -> dict[str, AppConfig]:
    # Router, prefill and decode on three different hosts: every hop crosses a host boundary.
    def pools(**router: object) -> dict[str, object]:
        return {
            "engine": {"model": "tiny", "kv_cache_memory_bytes": 64 * 1024**2},
            "prefill": {"cpu_cores": [0], "num_cpus": 0.5, "resources": on_host("c")},
            "decode": {"cpu_cores": [1], "num_cpus": 0.5, "resources": on_host("a")},
            "colocated": {"cpu_cores": [0], "num_cpus": 0.5, "resources": on_host("c")},
            "control": {"redis_url": redis_url},
            "router": {"default_max_tokens": 16, "resources": on_host("b"), **router},
            # Fixed pools: these apps test serving; test_autoscaling_app.py has its own app.
            "autoscaling": {"enabled": False},
        }

    return {
        # The default backend's app takes API keys, as `pdserve up` does; the others none.
        # Its key-limit checks wait up to 1 s for Redis (0.1 s by default): on this loaded
        # machine a slower answer served the request unlimited, and the rpm test saw a 200.
        "nixl": AppConfig.model_validate(
            {
                "name": "pd-nixl",
                **pools(api_keys_file=api_keys_file, key_limit_timeout_s=1.0),
            }
        ),
        "ray": AppConfig.model_validate(
            {"name": "pd-ray", "kv_transfer": {"backend": "ray"}, **pools()}
        ),
        "colocated": AppConfig.model_validate(
            {"name": "colocated", "topology": "colocated", **pools()}
        ),
    }


# The keys file's keys with limits (router/auth.py), beside the app's own unlimited key.
LIMITED_KEYS = {"one-at-a-time": "concurrency=1", "three-a-minute": "rpm=3"}


@dataclass(frozen=True)
class ServeProxy:
    grpc_target: str
    http_port: int


@pytest.fixture(scope="package")
def serve_proxy(ray_cluster: object) -> Iterator[ServeProxy]:
    """Serve on the session's cluster with its HTTP and gRPC proxies on free ports. Apps are
    deployed by the fixtures that need them, so a module runs beside only its own engines."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from deploy.local import GRPC_SERVICERS, free_ports

    http_port, grpc_port = free_ports(2)
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
    )
    yield ServeProxy(f"127.0.0.1:{grpc_port}", http_port)
    serve.shutdown()


@pytest.fixture(scope="package")
def serve_apps(
    serve_proxy: ServeProxy, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServedApp]]:
    """The disaggregated app over each KV backend and the colocated app, deployed together
    (their engines start in parallel) behind the package's Serve HTTP and gRPC proxy. The
    nixl app takes an API key (`ServedApp.api_key`)."""
    from ray import serve
    from ray.serve import api as serve_api

    from deploy.app import build_app
    from deploy.up import wait_serving
    from router.auth import key_line, new_key

    api_key = new_key()
    limited = tuple((name, new_key()) for name in LIMITED_KEYS)
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    lines = [key_line("e2e", api_key)]
    lines += [f"{key_line(name, key)} {LIMITED_KEYS[name]}" for name, key in limited]
    keys_file.write_text("\n".join(lines) + "\n")
    apps = {
        key: ServedApp(
            key,
            config,
            serve_proxy.grpc_target,
            serve_proxy.http_port,
            api_key if config.router.api_keys_file else None,
            limited if config.router.api_keys_file else (),
        )
        for key, config in _app_configs(redis_server.url, str(keys_file)).items()
    }
    for app in apps.values():
        serve_api._run(
            build_app(app.config), name=app.name, route_prefix=f"/{app.name}", _blocking=False
        )
    for app in apps.values():
        wait_serving(app.name, APP_TIMEOUT_S)
    yield apps
    for app in apps.values():
        serve.delete(app.name)


@contextmanager
def deployed(key: str, config: AppConfig, proxy: ServeProxy) -> Iterator[ServedApp]:
    """`config`'s app deployed alone behind the package's Serve proxies (at its own route), up
    until the block ends."""
    from ray.serve import api as serve_api

    from deploy.app import build_app
    from deploy.up import wait_serving

    app = ServedApp(key, config, proxy.grpc_target, proxy.http_port)
    serve_api._run(build_app(config), name=app.name, route_prefix=f"/{app.name}", _blocking=False)
    try:
        wait_serving(app.name, APP_TIMEOUT_S)
        yield app
    finally:
        delete_app(app.name)


def delete_app(name: str, timeout_s: float = 300.0) -> None:
    """Delete a Serve app and wait for it to go. Serve's own wait is 60 s, which a replica
    that is still starting (one replacing a killed engine's) can outlast."""
    from ray import serve

    serve.delete(name, _blocking=False)
    wait_for(f"app {name} to go", lambda: name not in serve.status().applications, timeout_s)


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Poll `check` each second until it holds; the seconds that took. Fails naming `what`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(1.0)
    return time.monotonic() - started


def replica_states(app: str, deployment: str) -> dict[str, int]:
    """Serve's count of `deployment`'s replicas per state ("RUNNING", "STARTING", ...)."""
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return {str(k): int(v) for k, v in states.items()}


def replica_actor(app: str, deployment: str, worker_id: str) -> Any:
    """The Serve replica actor of `deployment` in `app` whose engine goes by `worker_id`
    ("decode-x1y2z3": the pool and the replica's unique id)."""
    import ray

    from prefill_workers.replica import unique_id_of

    name = f"SERVE_REPLICA::{app}#{deployment}#{unique_id_of(worker_id)}"
    return ray.get_actor(name, namespace="serve")


def replica_actors(app: str, deployment: str) -> dict[str, Any]:
    """Each live replica actor of `deployment`, by its engine's worker id ("decode-x1y2z3")."""
    import ray

    from prefill_workers.replica import pool_worker_id

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {
        pool_worker_id(deployment.lower(), a["name"].removeprefix(prefix)): ray.get_actor(
            a["name"], namespace="serve"
        )
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


def replica_pid(actor: Any) -> int:
    """The PID of the Serve replica `actor`'s own process."""
    import os

    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))


def engine_core_pid(actor: Any) -> int:
    """The PID of the EngineCore process under the replica `actor`: the replica's own child,
    which vLLM titles VLLM::EngineCore."""
    from tests.procs import children_named

    (engine_core,) = children_named(replica_pid(actor), "EngineCore")
    return int(engine_core)
