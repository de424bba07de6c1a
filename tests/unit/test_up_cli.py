"""The local run's CLI surface without starting it: `up`'s phase lines, the Ray head's command
(dashboard on loopback), `pdserve env` for Ray's CLIs, `--version`, `status --json` and
`generate --json` (against the in-process fake router)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from control.records import DecisionRecord, PoolSLO
from deploy.local import HeadPorts, LocalRun, ray_head_command
from deploy.status import DeploymentState, StatusReport, format_status, status_json
from deploy.up import PhaseClock, replica_summary
from engine.messages import ReplicaLoad
from pdserve_cli import main

# The client tests' fake router on a free port (it moves with the proto's stubs).
from tests.unit.test_api_client import router  # noqa: F401


def make_run(tmp_path: Path, dashboard_port: int = 8266) -> LocalRun:
    return LocalRun(
        run_id="abc123",
        app="pdserve",
        ray_pid=1,
        ray_address="127.0.0.1:6390",
        redis_pid=2,
        redis_url="redis://:secret@127.0.0.1:7000/0",
        http_port=8000,
        grpc_port=9000,
        temp_dir=str(tmp_path),
        ray_token_path=str(tmp_path / "ray token"),
        api_key="pds-xyz",
        dashboard_port=dashboard_port,
    )


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_RUN_DIR", str(tmp_path))
    for name in ("PDSERVE_API_KEY", "RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_phase_clock_prints_each_phase_with_its_elapsed_time() -> None:
    out = io.StringIO()
    clock = PhaseClock(out)
    clock.started -= 12.34  # as if `up` began 12.34 s ago
    clock("starting Ray's head")
    clock("app DEPLOYING: Router RUNNING 1")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[  12.3 s] starting Ray's head"
    assert lines[1].startswith("[  12.3 s] app DEPLOYING")


def test_replica_summary_names_each_deployment_and_its_states() -> None:
    summary = replica_summary(
        "DEPLOYING",
        {"Router": {"RUNNING": 1}, "Prefill": {"STARTING": 1}, "Decode": {}},
    )
    assert summary == (
        "app DEPLOYING: Router RUNNING 1; Prefill STARTING 1; Decode no replicas yet"
    )
    assert replica_summary("DEPLOYING", {}) == "app DEPLOYING: no deployments yet"


def test_the_ray_head_keeps_its_dashboard_on_loopback(tmp_path: Path) -> None:
    argv = ray_head_command(HeadPorts(6390, 8266, 44228, 44218, 10002, 52366), 4, tmp_path)
    assert "--include-dashboard=true" in argv
    assert "--dashboard-host=127.0.0.1" in argv and "--dashboard-port=8266" in argv
    assert not any("0.0.0.0" in arg or "include-dashboard=false" in arg for arg in argv)
    # Ray's fixed defaults are never used: another Ray on the machine may hold them.
    assert {
        "--port=6390", "--ray-client-server-port=10002", "--dashboard-agent-listen-port=52366"
    } <= set(argv)  # fmt: skip
    ports = HeadPorts.pick()
    assert len(set(ports)) == len(ports)
    assert not {6379, 8265, 44227, 44217, 10001, 52365} & set(ports)


def test_ray_cli_env_points_rays_tools_at_the_run(tmp_path: Path) -> None:
    env = make_run(tmp_path).ray_cli_env()
    assert env == {
        "RAY_ADDRESS": "127.0.0.1:6390",  # `ray status` (the GCS)
        "RAY_DASHBOARD_ADDRESS": "http://127.0.0.1:8266",  # `serve status`, `serve deploy`
        "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8266",  # `ray job`
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray token"),
    }
    # A state file from before the dashboard was on: no dashboard to point at.
    assert "RAY_DASHBOARD_ADDRESS" not in make_run(tmp_path, dashboard_port=0).ray_cli_env()


def test_env_prints_exports_a_shell_can_eval(run_dir: Path) -> None:
    make_run(run_dir).save()
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "env"], capture_output=True, text=True, check=True
    )
    # The token's path has a space: the exports must survive the shell's word splitting.
    shown = subprocess.run(
        ["bash", "-c", 'eval "$1"; echo "$RAY_AUTH_TOKEN_PATH|$RAY_DASHBOARD_ADDRESS"', "-",
         proc.stdout],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert shown.stdout.strip() == f"{run_dir / 'ray token'}|http://127.0.0.1:8266"


def test_env_without_a_run_says_so(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 1
    assert "nothing is running" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdserve {version('pdserve')}"


def make_report(run: LocalRun | None) -> StatusReport:
    load = ReplicaLoad("decode-a", "decode", 0, 2, 0, 0.25, 100, 75, 1.0, 4, 1, 40)
    decision = DecisionRecord(1.0, "decode", 1, 2, "tpot_p95 over SLO", {"tpot_p95_s": 0.2})
    return StatusReport(
        app="pdserve",
        run=run,
        app_status="RUNNING",
        serve={
            "Router": DeploymentState("HEALTHY", {"RUNNING": 1}),
            "Decode": DeploymentState("UPSCALING", {"RUNNING": 1, "STARTING": 1}),
        },
        samples={"ttft": [0.1, 0.2, 0.3], "tpot": [0.05]},
        replicas=[load],
        decisions=[decision],
        latest=[decision],
        pins={"decode": None, "prefill": 2},
        slo=PoolSLO(ttft_p95_s=0.5, tpot_p95_s=0.06),
    )


def test_status_json_is_the_report_as_numbers(tmp_path: Path) -> None:
    data = json.loads(json.dumps(status_json(make_report(make_run(tmp_path)))))
    assert data["status"] == "RUNNING"
    assert data["endpoints"]["ray_dashboard"] == "http://127.0.0.1:8266"
    assert data["deployments"]["Decode"]["replica_states"] == {"RUNNING": 1, "STARTING": 1}
    pools = {p["pool"]: p for p in data["pools"]}
    assert pools["decode"]["num_running"] == 1 and pools["decode"]["target_replicas"] == 2
    assert pools["prefill"]["pin"] == 2 and pools["prefill"]["slo_p95_s"] == 0.5
    assert pools["prefill"]["observed_p95_s"] == pytest.approx(0.29)
    assert data["latencies"]["ttft"]["n"] == 3
    assert data["latencies"]["ttft"]["p50_s"] == pytest.approx(0.2)
    assert data["latencies"]["queue_wait"] == {"n": 0, "p50_s": None, "p95_s": None, "p99_s": None}
    assert data["replicas"][0]["num_kv_load_failures"] == 1
    assert data["warnings"] and "1 of 4 KV loads failed" in data["warnings"][0]
    assert data["decisions"][0]["inputs"] == {"tpot_p95_s": 0.2}
    # Another app's control-plane view: no local run, no Serve.
    bare = status_json(
        StatusReport(
            "other", None, "", None, {}, [], [], [], {}, None
        )
    )  # fmt: skip
    assert bare["endpoints"] is None and bare["deployments"] is None and bare["status"] is None


def test_status_text_names_the_dashboard_and_how_to_reach_it(tmp_path: Path) -> None:
    lines = format_status(make_report(make_run(tmp_path)))
    assert lines[0].startswith("app pdserve: RUNNING")
    assert "dashboard http://127.0.0.1:8266" in lines[1] and "pdserve env" in lines[1]
    decode = next(line for line in lines if line.strip().startswith("Decode"))
    assert "RUNNING: 1, STARTING: 1" in decode and "UPSCALING" in decode
    pool = next(line for line in lines if line.strip().startswith("decode "))
    assert "1/2" in pool and "TPOT 60ms" in pool


def test_generate_json_prints_one_object(
    run_dir: Path,
    router: tuple[object, str],  # noqa: F811 (the fixture imported above)
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", "hi", "--target", router[1], "--max-tokens", "3", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # the whole of stdout is one JSON object
    assert data["text"] == "Hello, world" and data["token_ids"] == [100, 101, 102]
    assert data["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 3
    assert data["timings"]["ttft_s"] == pytest.approx(0.1)
    assert main([*argv, "--stream"]) == 2
    assert "--stream" in capsys.readouterr().err
