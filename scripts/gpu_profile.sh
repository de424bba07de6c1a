#!/usr/bin/env bash
# Issue 15's GPU step profile, as one script for a machine with one GPU and PyTorch (no vLLM):
# Llama-2-7B's shape in bf16 with random weights, set beside the h100-llama2-7b profile (from
# Vidur's published H100 measurements), then Llama-3-8B's shape. docs/sim.md says how to read it.
#
#   bash scripts/gpu_profile.sh [OUT_DIR]        # default $OUT, else /tmp/gpu-profile
set -euo pipefail
out=${1:-${OUT:-/tmp/gpu-profile}}
python=${PYTHON:-python3}
mkdir -p "$out"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
    "$python" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} > "$out/env.txt" 2>&1
for shape in llama2-7b llama3-8b; do
    compare=()
    [[ $shape == llama2-7b ]] && compare=(--compare h100-llama2-7b)
    timeout 240 "$python" -m engine.sim.torch_profile --device cuda --shape "$shape" \
        --dtype bfloat16 "${compare[@]}" --out "$out/$shape.json" \
        > /dev/null 2> "$out/$shape.log" || echo "$shape: exit $?" >> "$out/env.txt"
done
cat "$out/env.txt" "$out"/*.log
