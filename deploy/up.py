"""`pdserve up` and `pdserve down` for local mode.

up:   redis-server -> ray start --head -> serve.start(HTTP, gRPC) -> serve.run(app)
      -> wait until gRPC Health says SERVING -> write the run state
down: serve.shutdown (engines stop gracefully) -> SIGTERM `ray start --block`
      -> SIGKILL whatever still carries the run marker -> stop redis -> remove the state
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from control.keys import REDIS_URL_ENV
from control.redis_server import start_redis_server
from deploy.config import AppConfig
from deploy.local import (
    GRPC_SERVICERS,
    RUN_MARKER,
    LocalRun,
    create_ray_token,
    load_run,
    marked_pids,
    new_run_id,
    port_is_free,
    ray_temp_dir,
    run_dir,
    start_ray_head,
    state_file,
    stop_pid,
    write_private_file,
)
from router.auth import key_line, new_key


class AlreadyUp(RuntimeError):
    pass


LOOPBACK = "127.0.0.1"
# Serve's gRPC proxy reads its message size limit (2 GiB by default) from its environment.
GRPC_MESSAGE_LIMIT_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def _cluster_env(config: AppConfig) -> dict[str, str]:
    """Settings of the local cluster's processes that come from the app's config: a gRPC
    message is held to the HTTP body's limit (larger ones end RESOURCE_EXHAUSTED in the proxy,
    before anything is parsed)."""
    return {GRPC_MESSAGE_LIMIT_ENV: str(config.router.max_body_bytes)}


def _num_cpus(config: AppConfig) -> int:
    # Logical CPUs for Ray: enough for every pool at its max size, whatever the cores.
    pools = config.pools.values()
    return max(os.cpu_count() or 1, int(sum(p.num_cpus * p.max_replicas for p in pools)) + 1)


# Where each listener of a local run binds. Serve's gRPC proxy takes no host: it binds every
# interface (ray.serve._private.grpc_util), so a local run always keeps its API keys.
LISTENERS = {"HTTP": LOOPBACK, "gRPC": "::"}


def check_no_auth_allowed(listeners: dict[str, str] = LISTENERS) -> None:
    """`--no-auth` only where nobody but this machine can connect."""
    exposed = [f"{name} on {host}" for name, host in listeners.items() if not _is_loopback(host)]
    if exposed:
        raise ValueError(
            "--no-auth is refused: not every listener is on loopback "
            f"({', '.join(exposed)}; Serve's gRPC proxy binds all interfaces). "
            "Use the API key `pdserve up` prints (clients read $PDSERVE_API_KEY)."
        )


def check_tls_files(cert: str, key: str) -> tuple[str, str]:
    """Both PEM files, as absolute paths (Serve's proxy opens them from another directory);
    a missing or unreadable one is an error naming it, before anything starts."""
    paths = []
    for name, value in (("--tls-cert", cert), ("--tls-key", key)):
        path = Path(value).expanduser().resolve()
        try:
            head = path.read_bytes()[:100]
        except OSError as exc:
            raise ValueError(f"{name} {value}: {exc.strerror or exc}") from exc
        if b"-----BEGIN " not in head:
            raise ValueError(f"{name} {value}: not a PEM file")
        paths.append(str(path))
    return paths[0], paths[1]


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def up(
    config: AppConfig,
    http_port: int = 8000,
    grpc_port: int = 9000,
    timeout_s: float = 900,
    auth: bool = True,
    tls: tuple[str, str] | None = None,
) -> LocalRun:
    """Start the run. With `auth` and no keys file in `config`, the run gets a fresh API key
    (hashed in its folder, the key itself in the 0600 run state for `generate` and `bench`).
    `tls` (certificate, key: PEM files) makes the HTTP proxy serve HTTPS only."""
    if not auth:
        check_no_auth_allowed()
    if tls is not None:
        tls = check_tls_files(*tls)
    existing = load_run()
    if existing is not None:
        if marked_pids(existing.run_id):
            raise AlreadyUp(
                f"pdserve is already up (gRPC {existing.grpc_target}); run `pdserve down` first"
            )
        state_file().unlink()  # a stale record of a run whose processes are gone
    for name, port in (("HTTP", http_port), ("gRPC", grpc_port)):
        if not port_is_free(port):
            raise ValueError(
                f"{name} port {port} is in use; pick another with --{name.lower()}-port"
            )
    if config.kv_transfer.host is None:  # one host: the engines listen on loopback only
        config = config.model_copy(
            update={"kv_transfer": config.kv_transfer.model_copy(update={"host": LOOPBACK})}
        )
    run_id = new_run_id()
    base = run_dir() / run_id
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_path = create_ray_token(base)
    api_key = ""
    if auth and config.router.api_keys_file is None:
        api_key = new_key()
        keys_path = base / "api-keys"
        write_private_file(keys_path, key_line("local", api_key) + "\n")
        config = config.model_copy(
            update={"router": config.router.model_copy(update={"api_keys_file": str(keys_path)})}
        )
    os.environ[RUN_MARKER] = run_id  # redis-server inherits it
    redis = start_redis_server(base / "redis")
    # The Ray head (so the Serve controller and its autoscaling policies) and build_app read the
    # control plane's URL from here; it carries the password, so it stays out of configs and logs.
    os.environ[REDIS_URL_ENV] = redis.url
    ray_pid = 0
    try:
        ray_pid, address = start_ray_head(
            run_id, base, _num_cpus(config), token_path, extra_env=_cluster_env(config)
        )
        run = LocalRun(
            run_id=run_id,
            app=config.name,
            ray_pid=ray_pid,
            ray_address=address,
            redis_pid=redis.pid,
            redis_url=redis.url,
            http_port=http_port,
            grpc_port=grpc_port,
            temp_dir=str(base),
            ray_token_path=str(token_path),
            api_key=api_key,
            tls_cert=tls[0] if tls else "",
            tls_key=tls[1] if tls else "",
        )
        run.save()
        config = config.model_copy(
            update={"control": config.control.model_copy(update={"redis_url": None})}
        )
        _deploy(run, config, timeout_s)
        return run
    except BaseException:
        _stop_all(run_id, ray_pid, redis.pid)
        state_file().unlink(missing_ok=True)
        raise
    finally:
        os.environ.pop(RUN_MARKER, None)
        os.environ.pop(REDIS_URL_ENV, None)


def _deploy(run: LocalRun, config: AppConfig, timeout_s: float) -> None:
    run.use_ray_auth()
    import ray
    from ray import serve
    from ray.serve import api as serve_api
    from ray.serve.config import gRPCOptions

    from deploy.app import build_app

    ray.init(
        address=run.ray_address, namespace="pdserve", logging_level="WARNING", log_to_driver=False
    )
    try:
        serve.start(
            http_options={
                "host": LOOPBACK,
                "port": run.http_port,
                **(
                    {"ssl_certfile": run.tls_cert, "ssl_keyfile": run.tls_key}
                    if run.tls_cert
                    else {}
                ),
            },
            grpc_options=gRPCOptions(port=run.grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
        )
        # Returns at once; wait_serving below bounds the wait and reports a failed deploy.
        serve_api._run(build_app(config), name=config.name, route_prefix="/", _blocking=False)
        wait_serving(run.app, timeout_s)
    finally:
        ray.shutdown()


def wait_serving(app_name: str, timeout_s: float) -> None:
    """Wait until the Serve app is RUNNING; raise with Serve's message if it failed."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        status = str(app.status) if app is not None else "MISSING"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or time.monotonic() > deadline:
            message = app.message if app is not None else ""
            raise RuntimeError(f"app {app_name} is {status}: {message}")
        time.sleep(1.0)


@dataclass(frozen=True)
class DownReport:
    run_id: str
    num_killed: int
    leftovers: list[int]


def down(timeout_s: float = 60) -> DownReport | None:
    run = load_run()
    if run is None:
        return None
    if marked_pids(run.run_id) and _alive_ray(run):
        _shutdown_serve(run, timeout_s)
    killed = _stop_all(run.run_id, run.ray_pid, run.redis_pid)
    state_file().unlink(missing_ok=True)
    shutil.rmtree(ray_temp_dir(run.run_id), ignore_errors=True)
    return DownReport(run.run_id, killed, marked_pids(run.run_id))


def _alive_ray(run: LocalRun) -> bool:
    return os.path.exists(f"/proc/{run.ray_pid}")


def _shutdown_serve(run: LocalRun, timeout_s: float) -> None:
    """Graceful: replicas' engines shut down their own child processes."""
    run.use_ray_auth()
    import ray
    from ray import serve

    try:
        ray.init(
            address=run.ray_address, namespace="pdserve", logging_level="ERROR", log_to_driver=False
        )
        serve.shutdown()
    except Exception as exc:  # the SIGTERM/SIGKILL below still stop everything
        print(f"pdserve down: graceful Serve shutdown failed ({exc}); stopping processes")
    finally:
        ray.shutdown()


def _stop_all(run_id: str, ray_pid: int, redis_pid: int) -> int:
    if ray_pid:
        stop_pid(ray_pid, timeout_s=30)
    leftovers = [pid for pid in marked_pids(run_id) if pid != redis_pid]
    for pid in leftovers:
        stop_pid(pid, timeout_s=5)
    stop_pid(redis_pid, timeout_s=10)
    return len(leftovers)
