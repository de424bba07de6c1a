"""Local mode for `pdserve up` / `pdserve down`: a private Ray head, a private redis-server and
the Serve app, all started by us and stopped by the PIDs we recorded, never by name.

Every process we start carries PDSERVE_RUN_ID in its environment and passes it to its children
(Ray workers, Serve replicas, vLLM engine processes), so `down` can find and stop exactly the
processes of this run and `leftover_pids` can prove none is left.

The run's state (ports, PIDs, Redis URL, the path of its Ray token, its API key) is a JSON file
(0600) under the run directory (PDSERVE_RUN_DIR, default ~/.cache/pdserve/run); `generate`,
`status`, `scale`, `slo`, `down` and `bench` read it.

Ray 2.60 refuses a token-auth cluster without a token. Each run makes its own with Ray's own
generator, keeps it in the run's folder (0600 from creation) and hands every process of the run
its path (RAY_AUTH_TOKEN_PATH): the user's ~/.ray is neither read nor written. Ray's dashboard
runs on loopback behind that token, so Ray's own CLIs (`serve status`, `serve deploy`,
`ray status`) reach the run with `LocalRun.ray_cli_env` (printed by `pdserve env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

# Re-exported: callers take them from here.
from engine.ports import LOOPBACK as LOOPBACK
from engine.ports import free_port as free_port
from engine.ports import free_ports as free_ports

RUN_MARKER = "PDSERVE_RUN_ID"
# Where Ray's CLIs look for a cluster: `ray status` the GCS, `serve` and `ray job` the dashboard.
# A shell that ran `eval "$(pdserve env)"` for an earlier run still has them: a new run's
# processes must not inherit them.
RAY_CLI_ADDRESS_VARS = ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS", "RAY_API_SERVER_ADDRESS")
RAY_TOKEN_FILE = "ray-token"
PRIVATE_FILE_MODE = 0o600
GRPC_SERVICERS = [
    "api.serve_grpc.add_PDServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def run_dir() -> Path:
    return Path(os.environ.get("PDSERVE_RUN_DIR", "~/.cache/pdserve/run")).expanduser()


@dataclass(frozen=True)
class LocalRun:
    run_id: str
    app: str
    ray_pid: int
    ray_address: str
    redis_pid: int
    redis_url: str
    http_port: int
    grpc_port: int
    temp_dir: str
    ray_token_path: str
    # The run's API key ("" when the app runs without keys): `generate` and `bench` send it.
    api_key: str = ""
    # The proxies' certificate and key (PEM files) when they serve TLS; "" for plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    # Ray's dashboard (HTTP, loopback, the run's Ray token); 0 in a state file from before it.
    dashboard_port: int = 0

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}/v1"

    def tls_roots(self) -> bytes | None:
        """What a client of this run trusts: its own certificate (None: plaintext)."""
        return Path(self.tls_cert).read_bytes() if self.tls_cert else None

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.dashboard_port}" if self.dashboard_port else ""

    def ray_cli_env(self) -> dict[str, str]:
        """What Ray's own CLIs need to reach this run: `ray status` reads RAY_ADDRESS (the
        GCS), `serve status|deploy` RAY_DASHBOARD_ADDRESS, `ray job` RAY_API_SERVER_ADDRESS,
        and all of them the run's token."""
        env = {"RAY_ADDRESS": self.ray_address, **ray_auth_env(Path(self.ray_token_path))}
        if self.dashboard_url:
            env["RAY_DASHBOARD_ADDRESS"] = self.dashboard_url
            env["RAY_API_SERVER_ADDRESS"] = self.dashboard_url
        return env

    def save(self) -> Path:
        path = state_file()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        write_private_file(path, json.dumps(asdict(self), indent=2))  # holds the Redis password
        return path

    def use_ray_auth(self) -> None:
        """Make this process (and what it starts) authenticate to the run's Ray."""
        use_ray_token(Path(self.ray_token_path))


def state_file() -> Path:
    return run_dir() / "local.json"


def load_run() -> LocalRun | None:
    """The local run's state; None when there is none. A state file from an older pdserve (no
    token path) is not a run this version can reach, and is reported as such."""
    try:
        data = json.loads(state_file().read_text())
    except FileNotFoundError:
        return None
    try:
        return LocalRun(**data)
    except TypeError as exc:
        raise RuntimeError(
            f"{state_file()} is not a run state of this pdserve ({exc}); stop that run's "
            "processes and remove the file"
        ) from exc


def client_api_key(explicit: str | None = None) -> str | None:
    """The API key a command sends: `explicit` (--api-key), else $PDSERVE_API_KEY, else the
    local run's; None when there is none."""
    from api.client import API_KEY_ENV

    if explicit:
        return explicit
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    run = load_run()
    return run.api_key if run is not None and run.api_key else None


def write_private_file(path: Path, text: str) -> None:
    """Create `path` readable by its owner only from the start (no window with wider modes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def create_ray_token(folder: Path) -> Path:
    """A new Ray auth token (Ray's own generator) in `folder`, mode 0600 from creation."""
    from ray._private.authentication.authentication_token_generator import (
        generate_new_authentication_token,
    )

    path = folder / RAY_TOKEN_FILE
    write_private_file(path, generate_new_authentication_token())
    return path


def ray_auth_env(token_path: Path) -> dict[str, str]:
    """What a process needs to join a cluster that uses the token at `token_path`."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def use_ray_token(token_path: Path) -> None:
    """Point this process at `token_path`. Ray reads its auth mode and token once and caches
    them; a process that already talked to another run's cluster (bench runs systems in turn)
    must drop both caches."""
    os.environ.update(ray_auth_env(token_path))
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on `port` now. Servers set SO_REUSEADDR, so connections
    of a stopped run still in TIME-WAIT do not keep them from binding; the probe does the same
    (without it, `up` right after `down` refused the port for a minute)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


class HeadPorts(NamedTuple):
    """The Ray head's ports that Ray fixes by default (GCS 6379, dashboard 8265, its metrics
    44227, the autoscaler's metrics 44217, client server 10001, agent 52365), each picked free:
    another Ray on the machine holding a default, or taking one after `down`, never meets this
    run."""

    gcs: int
    dashboard: int
    dashboard_metrics: int
    autoscaler_metrics: int
    client_server: int
    agent: int

    @classmethod
    def pick(cls) -> HeadPorts:
        return cls(*free_ports(len(cls._fields)))


def ray_head_command(ports: HeadPorts, num_cpus: int, temp_dir: Path) -> list[str]:
    """`ray start` for the run's head. The dashboard serves Serve's REST API (`serve status`,
    `serve deploy`) and Ray's state API on loopback only; the token guards it there too."""
    return [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        f"--port={ports.gcs}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=true",
        f"--dashboard-host={LOOPBACK}",
        f"--dashboard-port={ports.dashboard}",
        f"--ray-client-server-port={ports.client_server}",
        f"--dashboard-agent-listen-port={ports.agent}",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]


def start_ray_head(
    run_id: str,
    log_dir: Path,
    num_cpus: int,
    token_path: Path,
    timeout_s: float = 180,
    extra_env: dict[str, str] | None = None,
) -> tuple[int, str, int]:
    """`ray start --head --block` in its own session; returns (pid, GCS address, dashboard
    port) once the GCS answers. --block keeps the process: SIGTERM to it stops the whole local
    cluster. The timeout is generous: on two busy cores the head took over a minute.
    `extra_env` reaches every process of the cluster (Serve's proxy and controller read their
    settings there)."""
    ports = HeadPorts.pick()
    inherited = {k: v for k, v in os.environ.items() if k not in RAY_CLI_ADDRESS_VARS}
    env = {
        **inherited,
        # No flags for these two.
        "DASHBOARD_METRIC_PORT": str(ports.dashboard_metrics),
        "AUTOSCALER_METRIC_PORT": str(ports.autoscaler_metrics),
        **(extra_env or {}),
        **ray_auth_env(token_path),
        RUN_MARKER: run_id,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    log = (log_dir / "ray-start.log").open("ab")
    proc = subprocess.Popen(
        ray_head_command(ports, num_cpus, ray_temp_dir(run_id)),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"{LOOPBACK}:{ports.gcs}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {log.name}")
        # Printed once the GCS, raylet and object store are all up (not just the GCS port).
        if b"Ray runtime started" in Path(log.name).read_bytes():
            return proc.pid, address, ports.dashboard
        time.sleep(0.5)
    stop_pid(proc.pid)
    raise RuntimeError(f"Ray head did not come up within {timeout_s:.0f} s; see {log.name}")


def ray_temp_dir(run_id: str) -> Path:
    """Ray's session files for this run. Short on purpose: Ray puts unix sockets under it and
    AF_UNIX paths are capped at 107 bytes, which a deep run directory would exceed."""
    return Path(tempfile.gettempdir()) / f"pdserve-{run_id}"


def marked_pids(run_id: str) -> list[int]:
    """PIDs of live processes whose environment carries this run's marker."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def stop_pid(pid: int, timeout_s: float = 15) -> None:
    stop_pids([pid], timeout_s)


def stop_pids(pids: list[int], timeout_s: float = 15) -> None:
    """SIGTERM every one of `pids` at once; SIGKILL those still running `timeout_s` later."""
    running = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            running.append(pid)
    deadline = time.monotonic() + timeout_s
    while running and time.monotonic() < deadline:
        running = [pid for pid in running if pid_is_alive(pid)]
        if running:
            time.sleep(0.2)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pid_is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its reaper does not count)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
