"""Several hosts on one machine: Linux network namespaces joined by a bridge, and a Ray cluster
with one node per host.

    host a (root namespace)  pdt<id>a 198.18.N.1/24 --veth--+
    host b (pdt-<id>-b)      pdt<id>b 198.18.N.2/24 --veth--+-- bridge pdt<id>br (no address:
    host c (pdt-<id>-c)      pdt<id>c 198.18.N.3/24 --veth--+   the switch between the hosts)

Each host has its own loopback and its own address, so "localhost" on one host is not another
host: what dials 127.0.0.1 for a peer fails here as it would across machines. Addresses come
from 198.18.0.0/15 (RFC 2544, for network tests); N is picked free per run, so two test runs
on one machine do not collide. Every host reaches the others through a veth "NIC", never from
an address on the bridge itself: UCX (NIXL's transport) ignores bridge devices by default, so a
host whose address sits on a bridge cannot be reached over NIXL at all. Everything is created
and removed by name: this module touches only the namespaces, links and processes it made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local import marked_pids, ray_auth_env, stop_pids

HOST_NAMES = ("a", "b", "c")
_TEST_NET = ipaddress.ip_network("198.18.0.0/15")


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2): the tests say so and fail."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _used_subnets() -> set[str]:
    routes = _ip("-j", "route", "show").stdout
    return {str(r.get("dst", "")) for r in json.loads(routes or "[]")}


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_subnets()
    subnets = list(_TEST_NET.subnets(new_prefix=24))
    random.shuffle(subnets)
    for subnet in subnets:
        if str(subnet) not in used:
            return subnet  # type: ignore[return-value]
    raise HostsUnavailable("no free /24 in 198.18.0.0/15")


@dataclass
class Hosts:
    """Host "a" is the root namespace (where the tests run); the others are namespaces."""

    run_id: str
    subnet: ipaddress.IPv4Network
    names: tuple[str, ...]
    _made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pdt{self.run_id}br"

    def namespace(self, host: str) -> str | None:
        return None if host == "a" else f"pdt-{self.run_id}-{host}"

    def link(self, host: str) -> str:
        """The root-namespace end of `host`'s veth pair (what a link-down test cuts)."""
        return f"pdt{self.run_id}{host}p"

    def ip(self, host: str) -> str:
        return str(self.subnet.network_address + 1 + self.names.index(host))

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on `host` (inside its namespace)."""
        ns = self.namespace(host)
        return argv if ns is None else ["ip", "netns", "exec", ns, *argv]

    def set_link(self, host: str, up: bool) -> None:
        _ip("link", "set", self.link(host), "up" if up else "down")

    def create(self) -> None:
        prefix = f"/{self.subnet.prefixlen}"
        self._add("link", self.bridge, ["link", "add", self.bridge, "type", "bridge"])
        _ip("link", "set", self.bridge, "up")
        for host in self.names:
            ns, inner, outer = self.namespace(host), f"pdt{self.run_id}{host}", self.link(host)
            self._add("link", outer, ["link", "add", inner, "type", "veth", "peer", "name", outer])
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            setup = [
                ["addr", "add", self.ip(host) + prefix, "dev", inner],
                ["link", "set", inner, "up"],
            ]
            if ns is None:  # host a: the root namespace keeps its end of the pair
                for args in setup:
                    _ip(*args)
                continue
            self._add("netns", ns, ["netns", "add", ns])
            _ip("link", "set", inner, "netns", ns)
            for args in [*setup, ["link", "set", "lo", "up"]]:
                _ip("netns", "exec", ns, "ip", *args)

    def _add(self, kind: str, name: str, args: list[str]) -> None:
        _ip(*args)
        self._made.append((kind, name))

    def remove(self) -> None:
        """Remove what `create` made, newest first; safe to call twice or after a failed create."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()


def make_hosts(names: tuple[str, ...] = HOST_NAMES) -> Hosts:
    if os.geteuid() != 0:
        raise HostsUnavailable(
            "the multi-host tests build hosts as network namespaces, which needs root "
            f"(running as uid {os.geteuid()})"
        )
    try:
        _ip("-V")
    except (OSError, subprocess.CalledProcessError) as exc:
        raise HostsUnavailable(f"iproute2's `ip` is needed for network namespaces: {exc}") from exc
    hosts = Hosts(uuid.uuid4().hex[:4], _pick_subnet(), names)
    try:
        hosts.create()
    except subprocess.CalledProcessError as exc:
        hosts.remove()
        raise HostsUnavailable(
            f"could not build network namespaces ({' '.join(exc.cmd)}): {exc.stderr.strip()}"
        ) from exc
    return hosts


@dataclass
class HostCluster:
    """A Ray cluster with one node per host: the head on host a, workers joined with
    `ray start --address` inside the other namespaces. Each node has the resource `host_<x>`
    (1 unit), so a test places an actor or a Serve replica on a given host."""

    hosts: Hosts
    address: str
    token_path: Path
    marker: str
    pids: dict[str, int]
    temp_root: Path

    @property
    def head_ip(self) -> str:
        return self.hosts.ip("a")

    def shutdown(self) -> None:
        # All nodes at once: one after another, each could take its whole 20 s wait.
        stop_pids(list(self.pids.values()), timeout_s=20)
        kill_marked(self.marker)  # raylets, GCS, agents, workers the nodes left
        shutil.rmtree(self.temp_root, ignore_errors=True)


def kill_marked(marker: str, timeout_s: float = 10) -> None:
    """SIGKILL every process carrying `marker` (deploy.local.RUN_MARKER in its environment)
    and wait up to `timeout_s` for them to be gone."""
    for pid in marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.2)


def start_host_cluster(hosts: Hosts, num_cpus: int = 2, timeout_s: float = 180) -> HostCluster:
    from deploy.local import RUN_MARKER, create_ray_token, free_port

    marker = f"pdt-{hosts.run_id}"
    temp_root = Path(tempfile.mkdtemp(prefix=f"pdt-{hosts.run_id}-"))
    token_path = create_ray_token(temp_root)
    env = {
        **os.environ,
        **ray_auth_env(token_path),
        RUN_MARKER: marker,
        "RAY_USAGE_STATS_ENABLED": "0",
        # Metrics reach the agents' Prometheus endpoints every 2 s (Ray's default: 10 s), so
        # tests that read them wait less.
        "RAY_metrics_report_interval_ms": "2000",
    }
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    address = f"{hosts.ip('a')}:{port}"
    cluster = HostCluster(hosts, address, token_path, marker, {}, temp_root)
    try:
        for host in hosts.names:
            head = host == "a"
            argv = [
                ray_bin, "start", "--block", f"--node-ip-address={hosts.ip(host)}",
                f"--num-cpus={num_cpus}", f"--resources={json.dumps({f'host_{host}': 1})}",
                "--disable-usage-stats", f"--temp-dir={temp_root / host}",
            ]  # fmt: skip
            argv += (
                ["--head", f"--port={port}", "--include-dashboard=false"]
                if head
                else [f"--address={address}"]
            )
            log = temp_root / f"ray-{host}.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    hosts.command(host, argv),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            cluster.pids[host] = proc.pid
            _wait_started(proc, log, timeout_s)
        return cluster
    except BaseException:
        cluster.shutdown()
        raise


def _wait_started(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"ray start exited with {proc.returncode}: {tail}")
        if b"Ray runtime started" in log.read_bytes():
            return
        time.sleep(0.3)
    raise RuntimeError(f"a Ray node did not start within {timeout_s:.0f} s; see {log}")


def wait_nodes(num_nodes: int, timeout_s: float = 60) -> None:
    """Wait (in a driver already joined) until `num_nodes` Ray nodes are alive."""
    import ray

    deadline = time.monotonic() + timeout_s
    while sum(1 for n in ray.nodes() if n["Alive"]) < num_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {num_nodes} Ray nodes alive after {timeout_s:.0f} s")
        time.sleep(0.3)


__all__ = [
    "HostCluster",
    "Hosts",
    "HostsUnavailable",
    "kill_marked",
    "make_hosts",
    "start_host_cluster",
    "wait_nodes",
]
