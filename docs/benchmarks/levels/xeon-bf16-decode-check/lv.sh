for r in 1 2 3 4; do for lv in amx avx512-vnni avx2; do
  /work/main/.venv/bin/kvserve bench latency --model /work/bench/smollm2-bf16.gguf --cpu-isa $lv --prompt-lens 128 --prefill-iters 1 --decode-steps 128 --read-share-steps 0 --json /tmp/ab/lv-$lv-$r.json 2>&1 | grep -E '^│ decode' | sed "s/^/$lv $r /"
done; done
