from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _listed_commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)  # type: ignore[arg-type]


def test_help_lists_only_working_commands() -> None:
    # Each listed command has a test below that runs it for real.
    assert _listed_commands() == {"generate", "model"}
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "generate" in out and "model" in out


def test_model_prepare(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "prepare", "tiny"]) == 0
    assert str(tiny_model) in capsys.readouterr().out


def test_generate_runs_an_engine(tiny_model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "generate",
            "hello",
            "--model",
            "tiny",
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 generated" in proc.stderr


def test_generate_reports_bad_input() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "generate",
            "hi",
            "--model",
            "tiny",
            "--max-tokens",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr
