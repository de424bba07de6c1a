"""The plain-PyTorch step profile (engine/sim/torch_profile.py): its fit recovers a step model's
costs, its comparison is the shipped profile's own step times, and the script runs end to end
on a tiny Llama shape on this CPU (on a GPU it runs the same code on Llama-2-7B's shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.sim.profile import PROFILE_DIR, SimProfile, StepCosts, load_profile, profile_from_dict
from engine.sim.torch_profile import (
    SHAPES,
    Measurements,
    RandomLlama,
    comparison,
    fit,
    main,
    predicted,
)

COSTS = StepCosts(
    base_s=0.005, prefill_token_s=2e-5, prefill_attention_s=1.5e-9, decode_seq_s=1.5e-5,
    decode_context_s=2.2e-7,
)  # fmt: skip


def profile_of(costs: StepCosts) -> SimProfile:
    raw = json.loads((PROFILE_DIR / "h100-llama2-7b.json").read_text())
    raw["step"] = vars(costs)
    return profile_from_dict(raw)


def test_the_fit_recovers_the_costs_that_made_the_steps() -> None:
    grid = Measurements({n: 0.0 for n in (128, 512, 2048, 8192)}, {
        (b, c): 0.0 for b in (1, 32, 256) for c in (512, 4096)
    })  # fmt: skip
    steps = predicted(profile_of(COSTS), grid)
    fitted = fit(steps)
    for name, value in vars(COSTS).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name


def test_the_comparison_sets_each_measured_step_beside_the_profile_s() -> None:
    profile = load_profile("h100-llama2-7b")
    measured = Measurements({512: 0.02}, {(64, 1024): 0.03})
    rows = comparison(measured, predicted(profile, measured))
    expected_prefill = profile.step_seconds([(0, 512)], [])
    expected_decode = profile.step_seconds([], [1024] * 64)
    assert rows == [
        {
            "step": "prefill 512",
            "measured_s": 0.02,
            "reference_s": expected_prefill,
            "ratio": 0.02 / expected_prefill,
        },
        {
            "step": "decode 64 x 1024",
            "measured_s": 0.03,
            "reference_s": expected_decode,
            "ratio": 0.03 / expected_decode,
        },
    ]


def test_the_random_model_runs_prefill_and_decode_steps() -> None:
    shape = SHAPES["tiny"]
    model = RandomLlama(shape, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        logits = model.prefill(40)
        assert logits.shape == (1, shape.vocab) and torch.isfinite(logits).all()
        cache = model.new_cache(3, 50)
        assert cache[0].shape == (3, shape.num_kv_heads, 50, shape.head_dim)
        logits = model.decode(3, 50, cache)
        assert logits.shape == (3, shape.vocab) and torch.isfinite(logits).all()


def test_the_script_measures_fits_and_compares(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--threads", "1"]
    argv += ["--prefill-tokens", "16", "64", "--decode-batches", "1", "4"]
    argv += ["--decode-contexts", "32", "64", "--max-decode-kv-tokens", "128"]
    argv += ["--repeats", "2", "--warmup", "1", "--compare", "cpu-smollm2", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["prefill_s"]) == {"16", "64"}
    # 4 x 64 is past the KV bound of 128 tokens: not timed.
    assert set(report["decode_s"]) == {"1x32", "4x32", "1x64"}
    assert all(t > 0 for t in [*report["prefill_s"].values(), *report["decode_s"].values()])
    assert set(report["step"]) == set(vars(COSTS))
    steps = {row["step"]: row for row in report["compare"]["steps"]}
    assert len(steps) == 5 and steps["prefill 64"]["reference_s"] == pytest.approx(
        load_profile("cpu-smollm2").step_seconds([(0, 64)], [])
    )
    with pytest.raises(ValueError, match="unknown sim profile"):
        main(["--device", "cpu", "--shape", "tiny", "--compare", "no-such-profile"])
