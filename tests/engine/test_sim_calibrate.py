"""`pdserve sim calibrate` for real: the offline (or served) engine is timed and a loadable
profile written whose fitted step model reproduces what was measured."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sim.profile import profile_from_dict

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("how", ["offline", "served"])
def test_calibrate_writes_a_profile_that_fits_its_measurements(tmp_path: Path, how: str) -> None:
    """Offline: vLLM's LLM in this process; served: AsyncLLM, its EngineCore a child process."""
    out = tmp_path / "calibrated.json"
    command = [sys.executable, "-m", "pdserve_cli", "sim", "calibrate", "--name", "calibrated"]
    served = ["--served"] if how == "served" else []
    proc = subprocess.run(
        [*command, "--model", "tiny", "--cores", "0", "--out", str(out), *served],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    raw = json.loads(out.read_text())
    profile = profile_from_dict(raw)
    assert profile.name == "calibrated" and profile.step.base_s > 0
    assert f"cores 0, {how}" in raw["description"]
    # tiny: 4 layers, 2 KV heads of 32 in float32.
    assert profile.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4
    measured = raw["sources"][0]
    assert "prefill seconds by prompt length" in measured
    # What was measured is in the output and the profile's sources; a longer prompt took longer.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("prefill s by tokens:"))
    prefill = ast.literal_eval(line.split(":", 1)[1].strip())
    assert sorted(prefill) == [128, 512, 1024, 2048] and prefill[2048] > prefill[128] > 0
