"""Processes from /proc: parent links, a process tree, CPU seconds (the benchmarks' CPU per
token, and the tests' independent views of what `pdserve` started)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path


def parents() -> dict[int, int]:
    """pid -> parent pid, for every live process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def descendants(roots: Iterable[int]) -> set[int]:
    """`roots` and every live process below them."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if Path(f"/proc/{pid}").exists()]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def stat_of(path: Path) -> tuple[str, float]:
    """A /proc stat file's state letter and its user and system CPU seconds."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_of(pids: Iterable[int]) -> dict[int, float]:
    """pid -> user and system CPU seconds so far (processes gone meanwhile left out)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            found[pid] = stat_of(Path(f"/proc/{pid}/stat"))[1]
    return found
