for r in 1 2 3 4 5 6; do for d in pair widen; do
  KVSERVE_BF16_DOTS=$d /work/main/.venv/bin/kvserve bench latency --model /work/bench/smollm2-bf16.gguf --cpu-isa amx --prompt-lens 128 --prefill-iters 1 --decode-steps 128 --read-share-steps 0 --json /tmp/ab/d2-$d-$r.json 2>&1 | grep -E '^│ decode' | sed "s/^/$d $r /"
done; done
