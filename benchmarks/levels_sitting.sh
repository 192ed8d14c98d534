#!/bin/bash
# The "CPU kernel levels" table of BENCHMARKS.md in one sitting: every row's kvserve bench with
# llama.cpp built for the same level, level after level, the engines alternating inside each bench.
#
#   BENCH=DIR PEERS=PREFIX OUT=DIR bash benchmarks/levels_sitting.sh [LEVEL ...]
#
# BENCH holds the GGUF files (smollm2-{q4_0,q4_1,q8_0,bf16}.gguf: the default model's file and its
# `llama-quantize --allow-requantize` copies; llama1b-{q4_0,q4_k_m}.gguf and llama8b-q4_0.gguf from
# `python -m tools.make_model`). PEERS-LEVEL/bin holds llama.cpp built by
# `../shared/tools/build-llama-cpp.sh PEERS-LEVEL LEVEL`. Then:
#   python -m benchmarks.formats_table OUT/*.json
# ONLY=NAME[,NAME...] runs just those rows (names as in the JSON files: smol-bf16, 1b-q4_0, ...),
# for measuring a row again after a change that touches only its path.
set -u
BENCH=${BENCH:-/work/bench}; PEERS=${PEERS:-$HOME/.cache/kvserve-peers/llama.cpp}; OUT=${OUT:-docs/benchmarks/levels}
KV=${KVSERVE:-kvserve}
LEVELS=("$@"); [ ${#LEVELS[@]} -gt 0 ] || LEVELS=(avx2 avx512-vnni avx512-bf16)
export OPENBLAS_NUM_THREADS=1
mkdir -p "$OUT"
ONLY=${ONLY:-}
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
lat() {  # file level name [extra bench flags]
  wanted "$3" || return 0
  echo "== $(date -u +%H:%M:%S) latency $1 $2"
  $KV bench latency --model "$BENCH/$1.gguf" --cpu-isa "$2" --compare-llama-cpp "$PEERS-$2/bin" --prompt-lens 512 \
    --prefill-iters 1 --llama-cpp-rounds 3 --json "$OUT/lat-$3-$2.json" "${@:4}" 2>&1 | grep -E "^│ (decode|prefill)" | tail -2
}
thr() {  # file level name: 64 requests of 128 + 128 against llama-batched-bench
  wanted "thr-$3" || return 0
  echo "== $(date -u +%H:%M:%S) throughput $1 $2"
  $KV bench throughput --model "$BENCH/$1.gguf" --cpu-isa "$2" --compare-llama-cpp "$PEERS-$2/bin" \
    --json "$OUT/thr-$3-$2.json" 2>&1 | grep -E "^│ (kvserve|llama)" | tail -2
}
for lv in "${LEVELS[@]}"; do
  lat smollm2-q4_0 "$lv" smol-q4_0
  lat smollm2-q4_1 "$lv" smol-q4_1
  lat smollm2-q8_0 "$lv" smol-q8_0
  lat smollm2-bf16 "$lv" smol-bf16
  lat llama1b-q4_0 "$lv" 1b-q4_0
  lat llama1b-q4_k_m "$lv" 1b-q4_k_m
  thr smollm2-q4_1 "$lv" smol-q4_1
done
if [ -f "$BENCH/llama8b-q4_0.gguf" ] && [ -d "$PEERS-avx512-bf16/bin" ]; then
  lat llama8b-q4_0 avx512-bf16 8b-q4_0 --decode-steps 32
fi
wanted default || exit 0
echo "== $(date -u +%H:%M:%S) default bench latency at ${LEVELS[0]}, the lowest level asked (the under-a-minute target)"
/usr/bin/time -f "%e s wall" $KV bench latency --cpu-isa "${LEVELS[0]}" 2>&1 >/dev/null | tail -1
