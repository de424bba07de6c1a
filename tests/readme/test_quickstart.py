"""The README's main job, as a user runs it: `pdserve up` on the embedded default (a local Ray,
a private Redis, the default model on CPU, one prefill and one decode replica), a request
through it over gRPC, `pdserve status`, and `pdserve down` leaving no process of ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local import free_port, marked_pids, pid_is_alive

pytestmark = pytest.mark.engine

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def _pdserve(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PDSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def local_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], dict[str, object]]]:
    run_dir = tmp_path_factory.mktemp("run")
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir)}
    http_port, grpc_port = free_port(), free_port()
    up = _pdserve(
        env, "up", "--http-port", str(http_port), "--grpc-port", str(grpc_port), timeout=900
    )
    state_path = run_dir / "local.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"127.0.0.1:{grpc_port}" in up.stdout
        yield env, state
    finally:
        _pdserve(env, "down", timeout=180)


def test_generate_over_grpc_answers(local_run: tuple[dict[str, str], dict[str, object]]) -> None:
    env, _ = local_run
    done = _pdserve(env, "generate", "--chat", "What is the capital of France?")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    assert "finish=stop" in done.stderr
    streamed = _pdserve(env, "generate", "--stream", "--chat", "What is the capital of France?")
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert streamed.stdout.strip() == done.stdout.strip()


def test_bad_input_is_reported(local_run: tuple[dict[str, str], dict[str, object]]) -> None:
    env, _ = local_run
    bad = _pdserve(env, "generate", "hello", "--max-tokens", "0")
    assert bad.returncode == 2
    assert "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


def test_status_shows_pools_and_latencies(
    local_run: tuple[dict[str, str], dict[str, object]],
) -> None:
    env, _ = local_run
    status = _pdserve(env, "status")
    assert status.returncode == 0, status.stderr[-2000:]
    for pool in ("Prefill", "Decode", "Router"):
        line = next(line for line in status.stdout.splitlines() if line.strip().startswith(pool))
        assert "RUNNING: 1" in line
    ttft = next(line for line in status.stdout.splitlines() if line.strip().startswith("ttft"))
    assert int(ttft.split()[1]) >= 2  # the requests above were recorded


def test_down_leaves_no_process(local_run: tuple[dict[str, str], dict[str, object]]) -> None:
    env, state = local_run
    run_id = str(state["run_id"])
    assert marked_pids(run_id), "the run's processes should carry its marker"
    down = _pdserve(env, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert marked_pids(run_id) == []
    # (A zombie awaiting its reaper is not running: pid_is_alive says no.)
    assert not pid_is_alive(int(state["ray_pid"]))  # type: ignore[call-overload]
    assert not pid_is_alive(int(state["redis_pid"]))  # type: ignore[call-overload]
    again = _pdserve(env, "down")
    assert "nothing is running" in again.stdout
