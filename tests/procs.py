"""Independent views of processes and sockets, straight from /proc, for leak checks that must
not reuse the code they check (`pdserve down` finds its processes by an environment marker;
these follow parent links and socket inodes instead), and `run_pdserve`, which runs the CLI and,
when it hangs, says where."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

# `descendants` is re-exported: the tests take their process-tree views from here.
from bench.procfs import descendants as descendants
from bench.procfs import parents, stat_of

_LISTEN = "0A"


def _socket_inodes(pids: Iterable[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_sockets(pids: Iterable[int] | None) -> set[tuple[str, int]]:
    """(address, port) of TCP listeners in this network namespace, of `pids` only unless None.
    Addresses as the kernel shows them: "127.0.0.1", "0.0.0.0", "::", "::1" (an IPv4-mapped
    IPv6 address as the IPv4 one)."""
    wanted = None if pids is None else _socket_inodes(pids)
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != _LISTEN or (wanted is not None and fields[9] not in wanted):
                    continue
                address, port = fields[1].split(":")
                found.add((_address(address, width), int(port, 16)))
    return found


def listening_ports(pids: Iterable[int] | None) -> set[int]:
    return {port for _, port in listening_sockets(pids)}


def _address(hex_address: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    if width == 8:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc shows IPv6 as four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    # A dual-stack socket bound to an IPv4 address (gRPC binds "127.0.0.1" so) listens on that
    # address alone: shown as it, not as "::ffff:7f00:1".
    return str(address.ipv4_mapped or address)


def children_named(pid: int, needle: str) -> list[int]:
    """The direct children of `pid` whose command line contains `needle`."""
    found = []
    for child, parent in parents().items():
        if parent == pid:
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(child)
    return found


def _cores(spec: str) -> set[int]:
    """A cpulist ("0", "0-3", "0,2-3") as a set."""
    cores: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def pinned_cores(pids: Iterable[int]) -> set[int]:
    """The cores the threads of `pids` are bound to one each (a thread allowed a single core:
    how vLLM's CPU worker binds its OpenMP threads); threads allowed more are left out."""
    found: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    for line in (task / "status").read_text().splitlines():
                        if line.startswith("Cpus_allowed_list:"):
                            cores = _cores(line.split(":", 1)[1].strip())
                            if len(cores) == 1:
                                found |= cores
    return found


REPO = Path(__file__).resolve().parents[1]


def run_pdserve(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`python -m pdserve_cli ARGS` from the repository root. Past `timeout_s` the assertion says
    where the command was: its kernel state and wait channel, then every thread's Python stack
    (faulthandler, on SIGABRT), before it is killed."""
    command = [sys.executable, "-X", "faulthandler", "-m", "pdserve_cli", *args]
    started = time.monotonic()
    with subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kernel = kernel_state(proc.pid)
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(
                f"`pdserve {' '.join(args)}` still running after {time.monotonic() - started:.1f} s"
                f" ({kernel}); stdout: {out!r}; stderr, with its stacks:\n{err[-6000:]}"
            ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds `pid` has used, all its threads together."""
    return stat_of(Path(f"/proc/{pid}/stat"))[1]


def kernel_state(pid: int) -> str:
    """State, wait channel and CPU seconds of `pid` and its threads, from /proc."""
    parts = []
    with contextlib.suppress(OSError):
        for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
            with contextlib.suppress(OSError):
                state, cpu_s = stat_of(task / "stat")
                wchan = (task / "wchan").read_text().strip() or "-"
                parts.append(f"thread {task.name} {state} in {wchan}, {cpu_s:.2f} cpu-s")
    return "; ".join(parts) or "gone"
