#!/bin/bash
# Used for the "TTFT of disaggregated vs colocated serving" table in BENCHMARKS.md.
# Needs a release build and .ci/fetch-models (SmolLM2 GGUF).
# TTFT/ITL of disaggregated vs colocated serving, same model, same fixed-rate load.
# Defaults: the SmolLM2 proxy at ~1k-token prompts. For synthetic llama-1b at 2k:
#   M=.cache/bench-coldstart/llama-1b.preheat INPUT=2000 RATE=0.006 REQUESTS=4 OUT=8 \
#     scripts/bench-ttft-disagg.sh   (the snapshot comes from `bench coldstart`)
set -e
cd "$(dirname "$0")/.."
B=./target/release/preheat
mkdir -p .bench
M=${M:-.bench/smollm2.preheat}
[ -f $M ] || $B snapshot convert .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf -o $M >/dev/null
LOAD="--rate ${RATE:-0.1} --requests ${REQUESTS:-8} --input-tokens ${INPUT:-1000} --output-tokens ${OUT:-16} --max-input-tokens 4000 --slo-ttft 300 --slo-itl 5 --json"
$B engine serve --model $M --port 18500 --kv-cache-mib 1024 2>/dev/null & S=$!
until curl -sf localhost:18500/health >/dev/null; do sleep 0.2; done
$B bench serve --url http://127.0.0.1:18500 $LOAD > .bench/ttft-colocated.json
kill -TERM $S; wait $S || true
# Internal traffic carries a cluster token; registration is on the gateway's port + 1.
[ -f .bench/cluster-token ] || openssl rand -hex 32 > .bench/cluster-token
export PREHEAT_CLUSTER_TOKEN_FILE=$PWD/.bench/cluster-token
$B engine gateway --port 18600 2>/dev/null & G=$!
$B engine prefill --model $M --port 18610 --kv-port 18611 --kv-cache-mib 1024 --gateway http://127.0.0.1:18601 2>/dev/null & P=$!
$B engine decode --model $M --port 18620 --kv-cache-mib 1024 --gateway http://127.0.0.1:18601 2>/dev/null & D=$!
until [ "$(curl -sf -H "Authorization: Bearer $(cat .bench/cluster-token)" localhost:18601/internal/workers | grep -o '"prefill_peers":1' | wc -l)" = 1 ]; do sleep 0.2; done
$B bench serve --url http://127.0.0.1:18600 $LOAD > .bench/ttft-disagg.json
kill -TERM $P $D; sleep 2; kill -TERM $G; wait || true
python3 - <<'PY'
import json
for n in ['colocated','disagg']:
    r=json.load(open(f'.bench/ttft-{n}.json'))
    print(n, {k: r[k] for k in ['completed','failed','ttft_p50','ttft_p99','itl_p50','itl_p99','e2e_p50']})
PY
