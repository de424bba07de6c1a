#!/usr/bin/env bash
# pdserve beside vLLM's own OpenAI server on the same engine settings and cores, driven by vLLM's
# own benchmark client (`vllm bench serve`, through bench/vllm_bench.py, greedy): the tiny model, whose
# steps are cheap, so the serving layer shows. One after the other on this machine:
#   vllm        python -m vllm.entrypoints.openai.api_server (local.yaml's engine settings)
#   colocated   pdserve up --topology colocated --model tiny
#   disagg      pdserve up --model tiny (one prefill core, one decode core)
# Usage: bash bench/vs_vllm.sh OUT_DIR [CONCURRENCY] [NUM_PROMPTS]   (SYSTEMS="vllm colocated
# disaggregated" by default: a subset reruns those only)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/vs_vllm.sh OUT_DIR [CONCURRENCY] [NUM_PROMPTS]}
CONC=${2:-64}
NUM=${3:-256}
PY=.venv/bin/python
MODEL=$($PY -c "from engine.models import resolve_model; print(resolve_model('tiny'))")
mkdir -p "$OUT"
PORT=18123
SYSTEMS=${SYSTEMS:-vllm colocated disaggregated}

client() {  # label, base url, model name, api key
    OPENAI_API_KEY="$4" $PY -m bench.vllm_bench serve --backend openai-chat \
        --base-url "$2" --endpoint /v1/chat/completions --model "$3" --tokenizer "$MODEL" \
        --dataset-name random --random-input-len 64 --random-output-len 256 --ignore-eos \
        --num-prompts "$NUM" --max-concurrency "$CONC" --seed 0 --temperature 0 \
        --save-result --result-dir "$OUT" --result-filename "$1.json" > "$OUT/$1.txt" 2>&1
    $PY -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], 'done',
        d['completed'], 'failed', d['failed'], 'out tok/s %.0f' % d['output_throughput'],
        'TTFT P50 %.0f ms' % d['median_ttft_ms'], 'TPOT P50 %.1f ms' % d['median_tpot_ms'])" \
        "$OUT/$1.json" "$1"
}

wait_http() {  # url
    for _ in $(seq 600); do
        curl -sf "$1" > /dev/null && return 0
        sleep 1
    done
    echo "not up: $1" >&2
    return 1
}

# 1. vLLM's own server: local.yaml's engine settings (float32, block 32, 256 MiB of KV, 64
#    sequences, eager), on both cores.
if [[ " $SYSTEMS " == *" vllm "* ]]; then
VLLM_ENABLE_V1_MULTIPROCESSING=1 $PY -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --dtype float32 --max-model-len 2048 --block-size 32 \
    --kv-cache-memory-bytes 268435456 --max-num-seqs 64 --enforce-eager --seed 0 \
    --host 127.0.0.1 --port $PORT > "$OUT/vllm-server.log" 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null || true' EXIT
wait_http "http://127.0.0.1:$PORT/v1/models"
client vllm "http://127.0.0.1:$PORT" tiny ""
kill $VLLM_PID
wait $VLLM_PID 2>/dev/null || true
trap - EXIT
fi

# 2. and 3. pdserve, colocated then disaggregated.
for topology in colocated disaggregated; do
    [[ " $SYSTEMS " == *" $topology "* ]] || continue
    .venv/bin/pdserve up --model tiny --topology $topology --http-port $PORT \
        > "$OUT/up-$topology.log" 2>&1
    KEY=$($PY -c "from deploy.local import client_api_key; print(client_api_key(None) or '')")
    client "pdserve-$topology" "http://127.0.0.1:$PORT" tiny "$KEY"
    .venv/bin/pdserve down > /dev/null
done
