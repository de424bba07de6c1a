"""Share of a core each process used over an interval, from /proc/<pid>/stat (utime + stime):
where a machine's CPU goes while pdserve runs (docs/benchmarks.md).

    python -m bench.cpu_share 30        # top processes over 30 s
"""

from __future__ import annotations

import argparse
import os
import time


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """pid -> (user + system clock ticks so far, command line)."""
    found: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
        found[int(name)] = (int(fields[11]) + int(fields[12]), command[:100])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", type=float, nargs="?", default=30.0)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    before = cpu_ticks()
    time.sleep(args.seconds)
    after = cpu_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    shares = sorted(
        (((ticks - before[pid][0]) / hz / args.seconds, pid, command)
         for pid, (ticks, command) in after.items() if pid in before),
        reverse=True,
    )  # fmt: skip
    for share, pid, command in shares[: args.top]:
        print(f"{share:6.1%} {pid:7d} {command}")
    print(f"total {sum(s for s, _, _ in shares):.1%} of one core over {args.seconds:g} s")


if __name__ == "__main__":
    main()
