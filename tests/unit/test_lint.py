"""ruff and mypy run clean: part of the test command, so CI and the README agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
