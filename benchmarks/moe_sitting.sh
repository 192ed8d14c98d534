#!/bin/bash
# The mixture-of-experts rows of BENCHMARKS.md in one sitting: the OLMoE-1B-7B shape's batch-1
# decode and prefill 128 against llama.cpp built for the same level (the engines alternating inside
# each bench), then 64 × 128/128 against llama-batched-bench.
#
#   BENCH=DIR PEERS=PREFIX OUT=DIR bash benchmarks/moe_sitting.sh [LEVEL ...]
#
# BENCH holds olmoe-1b-7b-{q4_0,q8_0}.gguf (`python -m tools.make_model --shape olmoe-1b-7b
# --format q4_0|q8_0`); PEERS-LEVEL/bin holds llama.cpp built by
# `../shared/tools/build-llama-cpp.sh PEERS-LEVEL LEVEL`. Then:
#   python -m benchmarks.formats_table OUT/*.json
set -u
BENCH=${BENCH:-/work/bench}; PEERS=${PEERS:-$HOME/.cache/kvserve-peers/llama.cpp}; OUT=${OUT:-docs/benchmarks/moe}
KV=${KVSERVE:-kvserve}
LEVELS=("$@"); [ ${#LEVELS[@]} -gt 0 ] || LEVELS=(avx2 avx512-bf16)
export OPENBLAS_NUM_THREADS=1
mkdir -p "$OUT"
for lv in "${LEVELS[@]}"; do
  for fmt in q4_0 q8_0; do
    echo "== $(date -u +%H:%M:%S) latency olmoe-1b-7b-$fmt $lv"
    $KV bench latency --model "$BENCH/olmoe-1b-7b-$fmt.gguf" --cpu-isa "$lv" --compare-llama-cpp "$PEERS-$lv/bin" \
      --prompt-lens 128 --prefill-iters 1 --llama-cpp-rounds 2 --json "$OUT/lat-olmoe-1b-7b-$fmt-$lv.json" 2>&1 |
      grep -E "^│ (decode|prefill)|mixture of experts" | tail -3
  done
done
lv=${LEVELS[-1]}
echo "== $(date -u +%H:%M:%S) throughput olmoe-1b-7b-q4_0 $lv"
$KV bench throughput --model "$BENCH/olmoe-1b-7b-q4_0.gguf" --cpu-isa "$lv" --compare-llama-cpp "$PEERS-$lv/bin" \
  --json "$OUT/thr-olmoe-1b-7b-q4_0-$lv.json" 2>&1 | grep -E "^│ (kvserve|llama)|mixture of experts" | tail -3
