"""Disjoint cores per replica (engine/cores.py): the slices, and claims held by real processes
on real lock files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploy.config import AppConfig
from deploy.settings import engine_spec
from engine.cores import claim_cores, core_slices


def test_the_cores_are_cut_in_order_into_whole_slices() -> None:
    assert core_slices([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert core_slices([4, 5, 6], 2) == [(4, 5)]  # core 6 makes no whole slice
    assert core_slices([0, 1], 1) == [(0,), (1,)]
    with pytest.raises(ValueError, match="between 1 and the 2 core"):
        core_slices([0, 1], 3)


def test_each_claim_gets_a_slice_no_other_holds(tmp_path: Path) -> None:
    # Claims of one process are separate too (one open file each).
    assert claim_cores([0, 1, 2, 3], 2, "app.decode", tmp_path) == (0, 1)
    assert claim_cores([0, 1, 2, 3], 2, "app.decode", tmp_path) == (2, 3)
    # Every slice held: all the cores, shared.
    assert claim_cores([0, 1, 2, 3], 2, "app.decode", tmp_path) == (0, 1, 2, 3)
    # Another pool's slices are its own.
    assert claim_cores([0, 1, 2, 3], 2, "app.prefill", tmp_path) == (0, 1)


CLAIM = """
import sys, time
from pathlib import Path
from engine.cores import claim_cores
print(claim_cores([0, 1, 2], 1, "app.engine", Path(sys.argv[1])), flush=True)
time.sleep(60)
"""


def test_a_claim_lasts_as_long_as_its_process(tmp_path: Path) -> None:
    """A replica's claim is freed when its process ends, killed or not: its replacement gets
    the slice back."""
    first = subprocess.Popen(
        [sys.executable, "-c", CLAIM, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "(0,)"
        assert claim_cores([0, 1, 2], 1, "app.engine", tmp_path) == (1,)
    finally:
        first.kill()
        first.wait(timeout=30)
    assert claim_cores([0, 1, 2], 1, "app.engine", tmp_path) == (0,)


def test_a_pool_names_its_slices_and_its_claim_group() -> None:
    config = AppConfig.model_validate(
        {"name": "demo", "decode": {"cpu_cores": [0, 1], "cores_per_replica": 1}}
    )
    spec = engine_spec(config, "decode")
    assert (spec.cpu_cores, spec.cores_per_replica, spec.core_group) == ((0, 1), 1, "demo.decode")
    assert engine_spec(config, "prefill").cores_per_replica is None
    with pytest.raises(ValueError, match="cores_per_replica must be at most the number"):
        AppConfig.model_validate({"decode": {"cpu_cores": [0], "cores_per_replica": 2}})
    with pytest.raises(ValueError, match="cores_per_replica must be at most the number"):
        AppConfig.model_validate({"decode": {"cores_per_replica": 1}})
