"""Local mode for `pdserve up` / `pdserve down`: a private Ray head, a private redis-server and
the Serve app, all started by us and stopped by the PIDs we recorded, never by name.

Every process we start carries PDSERVE_RUN_ID in its environment and passes it to its children
(Ray workers, Serve replicas, vLLM engine processes), so `down` can find and stop exactly the
processes of this run and `leftover_pids` can prove none is left.

The run's state (ports, PIDs, Redis URL) is a JSON file under the run directory
(PDSERVE_RUN_DIR, default ~/.cache/pdserve/run); `generate` and `status` read it.
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

RUN_MARKER = "PDSERVE_RUN_ID"
# Ray 2.60 turns token auth on for new clusters; a driver joins only if it sends the token.
RAY_AUTH_ENV = {"RAY_AUTH_MODE": "token"}
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

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def save(self) -> Path:
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)  # holds the Redis password
        return path


def state_file() -> Path:
    return run_dir() / "local.json"


def load_run() -> LocalRun | None:
    try:
        return LocalRun(**json.loads(state_file().read_text()))
    except FileNotFoundError:
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_ray_head(
    run_id: str, log_dir: Path, num_cpus: int, timeout_s: float = 60
) -> tuple[int, str]:
    """`ray start --head --block` in its own session; returns (pid, GCS address) once the GCS
    answers. --block keeps the process: SIGTERM to it stops the whole local cluster."""
    port = free_port()
    env = {**os.environ, **RAY_AUTH_ENV, RUN_MARKER: run_id, "RAY_USAGE_STATS_ENABLED": "0"}
    log = (log_dir / "ray-start.log").open("ab")
    temp_dir = ray_temp_dir(run_id)
    ray_bin = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--num-cpus={num_cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {log.name}")
        # Printed once the GCS, raylet and object store are all up (not just the GCS port).
        if b"Ray runtime started" in Path(log.name).read_bytes():
            return proc.pid, address
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
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_is_alive(pid):
            return
        time.sleep(0.2)
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
