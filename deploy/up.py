"""`pdserve up` and `pdserve down` for local mode.

up:   redis-server -> ray start --head (dashboard on loopback) -> serve.start(HTTP, gRPC)
      -> serve.run(app) -> wait until the app is RUNNING; each phase is reported as it starts,
      and the replicas' states whenever they change (engines take 1-2 minutes on CPU)
down: serve.shutdown (engines stop gracefully) -> SIGTERM `ray start --block`
      -> SIGKILL whatever still carries the run marker -> stop redis -> remove the state
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from api import proxy_callback
from control.keys import REDIS_URL_ENV
from control.redis_server import start_redis_server
from deploy.config import AppConfig
from deploy.local import (
    GRPC_SERVICERS,
    LOOPBACK,
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
    stop_pids,
    write_private_file,
)
from deploy.status import state_name
from router.auth import key_line, new_key
from router.token_inbox import TOKEN_CHANNEL_HOST_ENV


class AlreadyUp(RuntimeError):
    pass


# Told each phase of `up` as it begins, in words ("starting Ray's head ...").
Report = Callable[[str], None]


def _silent(message: str) -> None:
    pass


class PhaseClock:
    """A `Report` that prints each phase with the seconds since `up` began, at once (flushed:
    the engines' start is a minute or two of otherwise silent waiting)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{elapsed:6.1f} s] {message}", file=self.out, flush=True)


# Serve's gRPC proxy reads its message size limit (2 GiB by default) from its environment.
GRPC_MESSAGE_LIMIT_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def _cluster_env(config: AppConfig, tls: tuple[str, str] | None) -> dict[str, str]:
    """Settings of the local cluster's processes: a gRPC message is held to the HTTP body's
    limit (larger ones end RESOURCE_EXHAUSTED in the proxy, before anything is parsed); Serve's
    gRPC proxy listens on loopback, with TLS when the run has a certificate; and the proxies
    refuse generation calls past the routers' admission themselves (api/proxy_gate.py); the
    routers' token channels listen on loopback."""
    router = config.router
    return {
        GRPC_MESSAGE_LIMIT_ENV: str(router.max_body_bytes),
        # One node: the routers' token channels on loopback too (router/token_inbox.py).
        TOKEN_CHANNEL_HOST_ENV: LOOPBACK,
        **proxy_callback.proxy_env(
            LOOPBACK,
            tls,
            router.max_in_flight * router.num_replicas if router.proxy_gate else 0,
            config.name,
        ),
    }


def ray_num_cpus(config: AppConfig) -> int:
    # Logical CPUs for Ray: enough for every pool at its max size, whatever the cores.
    pools = config.pools.values()
    return max(os.cpu_count() or 1, int(sum(p.num_cpus * p.max_replicas for p in pools)) + 1)


# Where each listener of a local run binds (Serve's gRPC proxy through api/grpc_listener.py).
LISTENERS = {"HTTP": LOOPBACK, "gRPC": LOOPBACK}


def check_no_auth_allowed(listeners: dict[str, str] = LISTENERS) -> None:
    """`--no-auth` only where nobody but this machine can connect."""
    exposed = [f"{name} on {host}" for name, host in listeners.items() if not _is_loopback(host)]
    if exposed:
        raise ValueError(
            "--no-auth is refused: not every listener is on loopback "
            f"({', '.join(exposed)}). "
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
    report: Report = _silent,
) -> LocalRun:
    """Start the run. With `auth` and no keys file in `config`, the run gets a fresh API key
    (hashed in its folder, the key itself in the 0600 run state for `generate` and `bench`).
    `tls` (certificate, key: PEM files) makes both proxies serve TLS only. `report` hears
    each phase as it begins."""
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
    report("starting a private Redis on loopback")
    redis = start_redis_server(base / "redis", persist=True)
    # The Ray head (so the Serve controller and its autoscaling policies) and build_app read the
    # control plane's URL from here; it carries the password, so it stays out of configs and logs.
    os.environ[REDIS_URL_ENV] = redis.url
    ray_pid = 0
    try:
        report("starting Ray's head (token auth, dashboard on loopback)")
        ray_pid, address, dashboard_port = start_ray_head(
            run_id, base, ray_num_cpus(config), token_path, extra_env=_cluster_env(config, tls)
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
            dashboard_port=dashboard_port,
        )
        run.save()
        report(f"Ray is up: GCS {run.ray_address}, dashboard {run.dashboard_url}")
        config = config.model_copy(
            update={"control": config.control.model_copy(update={"redis_url": None})}
        )
        _deploy(run, config, timeout_s, report)
        return run
    except BaseException:
        _stop_all(run_id, ray_pid, redis.pid)
        state_file().unlink(missing_ok=True)
        raise
    finally:
        os.environ.pop(RUN_MARKER, None)
        os.environ.pop(REDIS_URL_ENV, None)


def _deploy(run: LocalRun, config: AppConfig, timeout_s: float, report: Report) -> None:
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
        report(f"starting Serve (HTTP port {run.http_port}, gRPC port {run.grpc_port})")
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
        report(f"deploying {config.name} ({config.topology}, model {config.engine.model})")
        # Returns at once; wait_serving below bounds the wait and reports a failed deploy.
        serve_api._run(build_app(config), name=config.name, route_prefix="/", _blocking=False)
        wait_serving(run.app, timeout_s, report)
    finally:
        ray.shutdown()


def wait_serving(app_name: str, timeout_s: float, report: Report = _silent) -> None:
    """Wait until the Serve app is RUNNING; raise with Serve's message if it failed. `report`
    hears the replicas' states each time they change."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        app = serve.status().applications.get(app_name)
        status = str(app.status) if app is not None else "MISSING"
        if app is not None:
            states = {n: d.replica_states for n, d in app.deployments.items()}
            summary = replica_summary(state_name(app.status), states)
            if summary != last:
                report(summary)
                last = summary
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or time.monotonic() > deadline:
            message = app.message if app is not None else ""
            raise RuntimeError(f"app {app_name} is {status}: {message}")
        time.sleep(1.0)


def replica_summary(app_status: str, states: Mapping[str, Mapping[object, int]]) -> str:
    """One line of the app's progress: "app DEPLOYING: Router RUNNING 1; Prefill STARTING 1"."""
    parts = []
    for name, by_state in states.items():
        counts = ", ".join(f"{state_name(s)} {n}" for s, n in sorted(by_state.items(), key=str))
        parts.append(f"{name} {counts or 'no replicas yet'}")
    return f"app {app_status}: " + ("; ".join(parts) or "no deployments yet")


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
    stop_pids(leftovers, timeout_s=5)
    stop_pid(redis_pid, timeout_s=10)
    return len(leftovers)
