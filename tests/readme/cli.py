"""Running `pdserve` as a user does: the installed entry point, in a subprocess, under a fresh
HOME with no Ray or pdserve variables (only the model cache is passed in: building the default
model is the install step's job)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.models import cache_root

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def pdserve(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PDSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def fresh_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_"))}
    return {**env, "HOME": str(home), "PDSERVE_CACHE_DIR": str(cache_root())}
