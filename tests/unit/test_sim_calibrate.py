"""`pdserve sim calibrate`'s fit (engine/sim/calibrate.py) recovers a profile's step costs."""

from __future__ import annotations

import pytest

from engine.sim.calibrate import (
    DECODE_BATCHES,
    PREFILL_LENGTHS,
    Measurements,
    fit_step_costs,
)
from engine.sim.profile import load_profile


def test_the_fit_recovers_the_costs_that_made_the_measurements() -> None:
    profile = load_profile("cpu-smollm2")
    measured = Measurements(
        # Each offline call also costs 80 ms that no step does.
        prefill_s={n: 0.08 + profile.step_seconds([(0, n)], []) for n in PREFILL_LENGTHS},
        decode_step_s={b: profile.step_seconds([], [16] * b) for b in DECODE_BATCHES},
    )
    costs = fit_step_costs(measured)
    assert costs.base_s == pytest.approx(profile.step.base_s, rel=1e-6)
    assert costs.decode_seq_s == pytest.approx(profile.step.decode_seq_s, rel=1e-6)
    assert costs.prefill_token_s == pytest.approx(profile.step.prefill_token_s, rel=1e-6)
    assert costs.prefill_attention_s == pytest.approx(profile.step.prefill_attention_s, rel=1e-6)


def test_pdserve_sim_calibrate_parses() -> None:
    from deploy.cli import build_parser

    args = build_parser().parse_args(["sim", "calibrate", "--name", "mine", "--cores", "1"])
    assert (args.sim_command, args.name, args.cores) == ("calibrate", "mine", "1")
