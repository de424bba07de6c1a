"""Disjoint CPU cores for the replicas of one pool on one machine.

A pool's `cpu_cores` alone binds every replica of the pool to all of those cores: two engines
of the pool on one machine then run their OpenMP threads on the same cores (docs/benchmarks.md
measured what that costs). With `cores_per_replica` the cores are cut into slices of that many,
in order, and each replica claims a slice no other replica of the pool on this machine holds:

    cpu_cores [0, 1, 2, 3], cores_per_replica 2    slices (0, 1) and (2, 3)
    replica A starts    claims slice 0 -> computes on cores 0, 1
    replica B starts    slice 0 is held -> slice 1 -> cores 2, 3
    A dies              its claim goes with its process; A's replacement claims slice 0

A claim is an exclusive `flock` on a file per slice, held by the replica's process for its
life: the kernel frees it when the process ends, however it ends, so no claim outlives its
replica and none needs cleaning up. Serve's replica ranks are not used: Serve reassigns them
while replicas run (to keep them contiguous), and an engine's threads stay where they started.
A replica that finds every slice held computes on all the pool's cores, and says so.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# The claim files: one folder per machine (each node has its own temporary folder).
CLAIMS_DIR = Path(tempfile.gettempdir()) / "pdserve-cores"

# The open claim files of this process: a claim lasts as long as its descriptor.
_held: list[int] = []


def core_slices(cores: Sequence[int], per_replica: int) -> list[tuple[int, ...]]:
    """`cores` cut in order into slices of `per_replica` (cores past the last whole slice are
    left out)."""
    if per_replica < 1 or per_replica > len(cores):
        raise ValueError(
            f"cores_per_replica must be between 1 and the {len(cores)} core(s) given, "
            f"got {per_replica}"
        )
    return [
        tuple(cores[start : start + per_replica])
        for start in range(0, len(cores) - per_replica + 1, per_replica)
    ]


def claim_cores(
    cores: Sequence[int], per_replica: int, group: str, claims_dir: Path | None = None
) -> tuple[int, ...]:
    """The first slice of `cores` that no other process of `group` (an app's pool) on this
    machine holds, claimed for this process's life; all of `cores` when every slice is held."""
    folder = claims_dir or CLAIMS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", group)
    slices = core_slices(cores, per_replica)
    for index, piece in enumerate(slices):
        fd = os.open(folder / f"{stem}.{index}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        return piece
    logger.warning(
        "%s: all %d slices of %d core(s) are held by other replicas on this machine; this one "
        "computes on all of cores %s",
        group,
        len(slices),
        per_replica,
        list(cores),
    )
    return tuple(cores)
