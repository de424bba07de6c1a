"""Fit a sim profile's step costs (engine/sim/profile.py) from Vidur's public H100 profiling data.

    python scripts/sim_profile_from_vidur.py VIDUR_REPO MODEL_DIR TP LAYERS HIDDEN HEADS HEAD_DIM

VIDUR_REPO is a checkout of github.com/microsoft/vidur; MODEL_DIR a folder under
data/profiling/compute/h100/ (e.g. meta-llama/Llama-2-70b-hf). What comes from where:
- linear layers, norms, rope, activation (per layer, per tensor-parallel rank): Vidur's mlp.csv,
  median times (ms) against num_tokens; fitted as a + b x tokens over the decode range (1-256
  tokens: decode_seq_s) and the prefill range (512-4096: prefill_token_s), x LAYERS;
- tensor parallelism: two all-reduces per layer of tokens x HIDDEN fp16 values, from
  network/h100_dgx/all_reduce.csv (median time against size, linear fit);
- attention (Vidur's H100 attention.csv is not in its repository snapshot): roofline.
  Prefill: 4 x HEADS x HEAD_DIM FLOPs per (query, key) pair per layer at 350 TFLOP/s, the
  FlashAttention-2 forward speed on H100 (Dao, 2023: "up to 335-350 TFLOPs/s" on H100 SXM5);
  decode: the KV bytes read at 2.4 TB/s (72% of H100 SXM5's 3.35 TB/s HBM3, datasheet).
Prints the JSON "step" object.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import numpy as np

OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
ATTENTION_FLOPS_PER_S = 350e12
HBM_BYTES_PER_S = 2.4e12


def _rows(repo: str, path: str) -> list[dict[str, str]]:
    text = subprocess.run(
        ["git", "-C", repo, "show", f"HEAD:{path}"], capture_output=True, text=True, check=True
    ).stdout
    return list(csv.DictReader(io.StringIO(text)))


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(x), np.asarray(y), 1)
    return float(intercept), float(slope)


def main(repo: str, model: str, tp: int, layers: int, hidden: int, heads: int, hd: int) -> None:
    rows = [
        r
        for r in _rows(repo, f"data/profiling/compute/h100/{model}/mlp.csv")
        if int(r["num_tensor_parallel_workers"]) == tp
    ]
    tokens = [float(r["num_tokens"]) for r in rows]
    per_layer_ms = [sum(float(r[f"time_stats.{op}.median"]) for op in OPS) for r in rows]
    decode = [(t, y) for t, y in zip(tokens, per_layer_ms, strict=True) if t <= 256]
    prefill = [(t, y) for t, y in zip(tokens, per_layer_ms, strict=True) if t >= 512]
    d_a, d_b = _fit([t for t, _ in decode], [y for _, y in decode])
    _, p_b = _fit([t for t, _ in prefill], [y for _, y in prefill])
    ar_a = ar_b = 0.0
    if tp > 1:
        ar = [
            r
            for r in _rows(repo, "data/profiling/network/h100_dgx/all_reduce.csv")
            if int(r["num_workers"]) == tp
        ]
        ar_a, ar_b = _fit(
            [float(r["size"]) for r in ar], [float(r["time_stats.all_reduce.median"]) for r in ar]
        )
    # Two all-reduces per layer, each of tokens x hidden values.
    base_ms = layers * (d_a + 2 * ar_a)
    per_token_ms = layers * 2 * ar_b * hidden
    step = {
        "base_s": base_ms / 1e3,
        "decode_seq_s": (layers * d_b + per_token_ms) / 1e3,
        "prefill_token_s": (layers * p_b + per_token_ms) / 1e3,
        "prefill_attention_s": 4 * heads * hd * layers / (ATTENTION_FLOPS_PER_S * tp),
    }
    print(json.dumps(step, indent=2))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]))
