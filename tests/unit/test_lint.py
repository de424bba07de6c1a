"""ruff and mypy run clean, and buf lints the proto clean: part of the test command, so CI and
the README agree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where scripts/install.sh puts buf (npm's @bufbuild/buf): beside the environment's python.
BUF = Path(sys.prefix) / "bin" / "buf"


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


def buf_lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    assert BUF.exists(), f"{BUF} is missing: scripts/install.sh installs it (npm @bufbuild/buf)"
    return subprocess.run([str(BUF), "lint"], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_buf_lint_clean() -> None:
    proc = buf_lint(REPO)  # buf.yaml: the module api/proto, buf's STANDARD rules
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_buf_lint_fails_on_a_lint_error(tmp_path: Path) -> None:
    # The same config over a copy of the proto with one enum value named against the rules.
    shutil.copy(REPO / "buf.yaml", tmp_path)
    shutil.copytree(REPO / "api" / "proto", tmp_path / "api" / "proto")
    proto = tmp_path / "api" / "proto" / "pdserve" / "v1" / "pdserve.proto"
    proto.write_text(proto.read_text().replace("FINISH_REASON_STOP = 1", "STOP = 1"))
    proc = buf_lint(tmp_path)
    assert proc.returncode != 0
    assert 'Enum value name "STOP" should be prefixed with "FINISH_REASON_"' in proc.stdout
