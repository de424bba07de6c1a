"""Ports for the servers pdserve starts: free now, and outside the kernel's ephemeral range.

A port the kernel hands out for a bind to port 0 is one it may hand out again, to any process
that binds or connects before the server we pick it for binds it. It happened to `pdserve up`:
the decode engine's NIXL side channel was given a port that a vLLM worker starting beside it
took in between; the listener thread died on EADDRINUSE, and vLLM waits for that thread with no
timeout, so the replica never started. Ports below the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range) are never handed out that way: only a process that
names one takes it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
# Below this: well-known and commonly configured ports (Redis 6379, Ray's dashboard 8265) and
# Ray's worker ports (10002-19999 by default), which `ray start` refuses to see given to any
# other of its components.
LOWEST_PORT = 20_000
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 500


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in _PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def candidate_ports() -> range:
    """Where `free_ports` looks: below the ephemeral range, else above it."""
    low, high = ephemeral_range()
    below = range(LOWEST_PORT, low)
    return below if len(below) >= 1_000 else range(high + 1, 65_536)


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` different TCP ports that a server can bind on `host` now, none of them one the
    kernel hands out for port 0."""
    candidates = candidate_ports()
    picked: list[int] = []
    for port in random.sample(candidates, min(len(candidates), _TRIES)):
        if _bindable(host, port):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise RuntimeError(
        f"no {count} free TCP ports on {host} in {candidates.start}-{candidates.stop - 1} "
        f"after {_TRIES} tries"
    )


def free_port(host: str = LOOPBACK) -> int:
    return free_ports(1, host)[0]


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
