from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _listed_commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)  # type: ignore[arg-type]


def test_help_lists_only_working_commands() -> None:
    # Each listed command has a test that runs it for real: `model` and `generate --local`
    # below, `up`, `generate`, `status` and `down` in tests/readme/test_quickstart.py.
    # `slo` and `scale`: tests/e2e/test_autoscaling_serve_policy.py and test_autoscaling_app.py.
    # `bench run` and `bench compare`: tests/e2e/test_bench_run.py. `keys`: below. `env`:
    # tests/unit/test_up_cli.py, and with Ray's own CLIs in tests/readme/test_quickstart.py.
    # `sim calibrate`: tests/engine/test_sim_calibrate.py. `plan`: below. `role`:
    # tests/e2e/test_routing.py (the role-flip test).
    assert _listed_commands() == {
        "up", "down", "status", "env", "generate", "model", "slo", "scale", "bench", "keys", "sim",
        "plan", "role",
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "generate" in out and "model" in out


def test_plan_prints_each_candidate_and_the_pick(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["plan", "--workload", "long-prompt", "--tpot", "0.1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    names = [(r["candidate"]["kind"], r["candidate"]["num_prefill"]) for r in shown["results"]]
    assert names == [("colocated", 0), ("disaggregated", 1), ("adaptive", 0), ("adaptive", 1)]
    assert shown["tpot_slo_s"] == 0.1 and shown["ttft_slo_s"] == 15.0
    assert shown["num_engines"] == 2 and shown["profile"] == "cpu-smollm2"
    goodput = {r["candidate"]["kind"]: r["goodput"] for r in shown["results"][:3]}
    assert shown["pick"] == "disaggregated 1:1", goodput
    assert main(["plan", "--workload", "chat"]) == 0
    text = capsys.readouterr().out
    assert "colocated x2" in text and "adaptive 1:1" in text and "\npick: " in text
    wide = ["plan", "--workload", "chat", "--wider", "2=cpu-smollm2-2c-fit", "--json"]
    assert main(wide) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["candidate"]["width"] for r in shown["results"]] == [1, 1, 1, 1, 2]
    with pytest.raises(SystemExit):
        main(["plan", "--wider", "two=cpu-smollm2-2c-fit"])
    assert "expected N=PROFILE" in capsys.readouterr().err


def test_keys_new_prints_a_key_and_only_its_hash_for_the_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from router.auth import ApiKeys

    assert main(["keys", "new", "ci-bot"]) == 0
    out = capsys.readouterr().out.splitlines()
    key = out[0].removeprefix("API key: ")
    line = out[1].rsplit(": ", 1)[1]
    assert key.startswith("pds-") and key not in line
    assert ApiKeys.parse(line).authenticate(key) == "ci-bot"
    assert main(["keys", "new", "two words"]) == 2
    assert "API key" not in capsys.readouterr().out  # no key is printed for a refused name


def test_model_prepare(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "prepare", "tiny"]) == 0
    assert str(tiny_model) in capsys.readouterr().out


def test_generate_local_runs_an_engine(tiny_model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve_cli",
            "generate",
            "hello",
            "--local",
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
            "pdserve_cli",
            "generate",
            "hi",
            "--local",
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


def test_commands_without_a_run_say_so(tmp_path: Path) -> None:
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    for command, rc, text in [
        ("down", 0, "nothing is running"),
        ("status", 1, "nothing is running"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve_cli", command],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=120,
        )
        assert proc.returncode == rc, proc.stderr
        assert text in proc.stdout


def test_generate_without_a_server_fails_clearly(tmp_path: Path) -> None:
    from deploy.local import free_port

    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve_cli",
            "generate",
            "hi",
            "--target",
            f"127.0.0.1:{free_port()}",
            "--timeout",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "UNAVAILABLE" in proc.stderr or "DEADLINE_EXCEEDED" in proc.stderr
