#!/bin/bash
# The proxy gate off, then on (router.proxy_gate), each against a fresh `pdserve up` of
# deploy/configs/local.yaml with router.max_in_flight 20: bench.overload's bursts of 200, 50,
# 10 and 1 past 20 held streams. docs/benchmarks.md has what it printed.
#   bash bench/overload_gate.sh [OUT_DIR]            real engines (the default model)
#   UP_ARGS="--engine sim" MAX_TOKENS=256 bash bench/overload_gate.sh [OUT_DIR]
# CLIENTS=N sends each burst from N client processes (bench.overload --clients).
set -u
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
export PDSERVE_RUN_DIR="$out/run"
for gate in false true; do
  config="$out/local-gate-$gate.yaml"
  sed -e "s/max_in_flight: 256/max_in_flight: 20\n        proxy_gate: $gate/" \
    deploy/configs/local.yaml > "$config"
  # shellcheck disable=SC2086  # UP_ARGS is a list of arguments
  if ! .venv/bin/pdserve up ${UP_ARGS:-} --config "$config" --http-port 18000 --grpc-port 19000 \
      > "$out/up-gate-$gate.log" 2>&1; then
    tail "$out/up-gate-$gate.log"
    .venv/bin/pdserve down
    exit 1
  fi
  for burst in 200 50 10 1; do
    echo "gate=$gate burst=$burst"
    .venv/bin/python -m bench.overload --hold 20 --burst "$burst" \
      --max-tokens "${MAX_TOKENS:-64}" --clients "${CLIENTS:-1}" | tee "$out/gate-$gate-burst-$burst.json"
  done
  .venv/bin/pdserve down
done
echo "results in $out"
