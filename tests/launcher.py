"""The Ray cluster launcher's recipe (deploy/cluster/ray-cluster.yaml) run on hosts of this
machine: a head and two workers, each a network namespace (tests/hosts.py), started by the
recipe's own `head_start_ray_commands` and `worker_start_ray_commands`, run by bash as the
launcher runs them, in a home folder laid out as the launcher leaves a node's:

    $HOME/venv      this checkout's virtual environment (setup_commands' install.sh made it)
    $HOME/pdserve   the checkout, holding the Serve config file the head deploys
    $HOME/.pdserve-redis-password, $HOME/.pdserve-ray-token   the file_mounts

What this machine changes, and only this (`node_commands`):
- `ray stop` is dropped: it would stop every Ray process on the machine, not only this
  cluster's (ours are stopped by their own PIDs: each carries the cluster's marker);
- the AWS autoscaler's `--autoscaling-config` is dropped (no provider here; the worker
  count is fixed at 2);
- each `ray start` gets what the launcher gives it from `available_node_types` (CPUs, GPUs:
  a worker's one GPU is a logical Ray resource here), a temp folder of its own, and no usage
  stats;
- the Serve config is deploy/configs/gpu-cluster.yaml with its engine on this machine's CPU
  (`cpu_serve_config`): the tiny model's folder in place of the model's, one replica a pool
  (one per worker, as their one GPU each allows), each engine on a core of its own.
setup_commands (apt, clone, install, model download) are not run: the checkout and its
environment stand for them, and the model folder is on every host (one filesystem).
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.local import RUN_MARKER, marked_pids, stop_pids
from tests.hosts import Hosts, kill_marked

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "deploy" / "cluster" / "ray-cluster.yaml"
SERVE_CONFIG = "deploy/configs/gpu-cluster.yaml"
HEAD, WORKERS = "h", ("w1", "w2")
HOST_NAMES = ("a", HEAD, *WORKERS)  # a: this namespace, where the test runs (the client)
MODEL_FOLDER = "/mnt/models/Qwen2.5-7B-Instruct"
# The head's dashboard, as the recipe starts it (--dashboard-host=127.0.0.1, Ray's port).
DASHBOARD = "http://127.0.0.1:8265"


def cpu_serve_config(gpu_config: dict[str, Any], model_folder: Path) -> dict[str, Any]:
    """deploy/configs/gpu-cluster.yaml with its engines on this machine's CPU cores."""
    config = copy.deepcopy(gpu_config)
    args = config["applications"][0]["args"]
    assert args["engine"]["model"] == MODEL_FOLDER, "the launcher's model folder moved"
    args["engine"] = {
        "model": str(model_folder),
        "served_name": args["engine"]["served_name"],
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 2048,
        "block_size": 32,
        "kv_cache_memory_bytes": 64 * 1024**2,
        "max_num_seqs": 16,
        "engine_kwargs": args["engine"]["engine_kwargs"],
    }
    for core, pool in enumerate(("prefill", "decode")):
        args[pool].update(num_replicas=1, min_replicas=1, max_replicas=1, cpu_cores=[core])
    return config


def _node_resources(config: dict[str, Any], node_type: str) -> list[str]:
    resources = config["available_node_types"][node_type]["resources"]
    return [f"--num-cpus={resources['CPU']}", f"--num-gpus={resources['GPU']}"]


def node_commands(config: dict[str, Any], head: bool, temp_dir: Path) -> list[str]:
    """The launcher's start commands for the head or a worker, as this machine runs them."""
    key = "head_start_ray_commands" if head else "worker_start_ray_commands"
    node_type = config["head_node_type"] if head else "gpu_worker"
    commands = []
    for command in config[key]:
        if re.search(r"\bray stop\b", command):
            continue
        command = re.sub(r" --autoscaling-config=\S+", "", command)
        if re.search(r"\bray start\b", command):
            extra = [*_node_resources(config, node_type), f"--temp-dir={temp_dir}"]
            command += " " + " ".join([*extra, "--disable-usage-stats"])
        commands.append(command)
    return commands


@dataclass
class LauncherCluster:
    hosts: Hosts
    home: Path
    marker: str
    redis_password: str

    # What the recipe puts before each Ray command (the token its file_mounts copied).
    auth_env = "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.pdserve-ray-token"

    @property
    def head_ip(self) -> str:
        return self.hosts.ip(HEAD)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.home),
            RUN_MARKER: self.marker,
            "RAY_USAGE_STATS_ENABLED": "0",
            **extra,
        }

    def bash(self, host: str, command: str, timeout_s: float, **env: str) -> str:
        """`command` run by bash on `host` from the home folder, as the launcher runs it; its
        output. Through files, not pipes: what a command leaves running (Ray's daemons) would
        hold a pipe open after the command exits."""
        out, err = self.home / "command.out", self.home / "command.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            returncode = subprocess.run(
                self.hosts.command(host, ["bash", "-c", command]),
                cwd=self.home,
                env=self.env(**env),
                stdout=stdout,
                stderr=stderr,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            ).returncode
        if returncode != 0:
            raise RuntimeError(
                f"on host {host}, `{command}` exited with {returncode}:\n"
                f"{out.read_text()[-3000:]}\n{err.read_text()[-3000:]}"
            )
        return out.read_text()

    def ray_cli(self, *args: str, timeout_s: float = 60) -> Any:
        """`ray <args> --format json` on the head, with the cluster's token, against its
        dashboard (on the head's loopback only). The address is given: Ray's CLI otherwise
        looks for clusters among the machine's processes, and finds the other test clusters'."""
        argv = " ".join(["$HOME/venv/bin/ray", *args, "--address", DASHBOARD, "--format", "json"])
        return json.loads(self.bash(HEAD, f"{self.auth_env} {argv}", timeout_s))

    def actor_hosts(self, class_prefix: str) -> dict[str, str]:
        """Alive actors whose class name starts with `class_prefix`: name -> host name."""
        by_ip = {self.hosts.ip(host): host for host in self.hosts.names}
        node_ips = {n["node_id"]: n["node_ip"] for n in self.ray_cli("list", "nodes")}
        actors = self.ray_cli("list", "actors", "--detail", "--limit", "1000")
        return {
            actor["name"]: by_ip[node_ips[actor["node_id"]]]
            for actor in actors
            if actor["state"] == "ALIVE" and actor["class_name"].startswith(class_prefix)
        }

    def shutdown(self) -> None:
        # Redis by the recipe's pidfile: its process title overwrites its environment, marker
        # included, so /proc shows no marker for it.
        pidfile = self.home / ".pdserve-redis.pid"
        redis_pids = [int(pidfile.read_text())] if pidfile.exists() else []
        stop_pids([*redis_pids, *marked_pids(self.marker)], timeout_s=20)
        kill_marked(self.marker)
        shutil.rmtree(self.home, ignore_errors=True)


def start_launcher_cluster(hosts: Hosts, model_folder: Path) -> LauncherCluster:
    """The recipe's head and workers started on `hosts` and its Serve config deployed (the
    head's last start command); returns once every command exited 0."""
    config = yaml.safe_load(LAUNCHER.read_text())
    home = Path(tempfile.mkdtemp(prefix=f"pdt-{hosts.run_id}-launcher-"))
    cluster = LauncherCluster(hosts, home, f"pdt-{hosts.run_id}-launcher", secrets.token_hex(24))
    try:
        (home / "venv").symlink_to(ROOT / ".venv")
        checkout = home / "pdserve"
        (checkout / SERVE_CONFIG).parent.mkdir(parents=True)
        gpu_config = yaml.safe_load((ROOT / SERVE_CONFIG).read_text())
        (checkout / SERVE_CONFIG).write_text(
            yaml.safe_dump(cpu_serve_config(gpu_config, model_folder), sort_keys=False)
        )
        # The file_mounts, as `ray up` copies them (made as the recipe's comment says).
        mounts = {
            "~/.pdserve-redis-password": cluster.redis_password,
            "~/.pdserve-ray-token": secrets.token_hex(32),
        }
        assert set(mounts) == set(config["file_mounts"]), "the recipe's file_mounts changed"
        for name, value in mounts.items():
            path = home / name.removeprefix("~/")
            path.write_text(value + "\n")
            path.chmod(0o600)
        for command in node_commands(config, head=True, temp_dir=home / "ray-head"):
            cluster.bash(HEAD, command, timeout_s=300)
        for worker in WORKERS:
            for command in node_commands(config, head=False, temp_dir=home / f"ray-{worker}"):
                cluster.bash(worker, command, timeout_s=180, RAY_HEAD_IP=cluster.head_ip)
        return cluster
    except BaseException:
        cluster.shutdown()
        raise
