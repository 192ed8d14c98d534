"""One phase of the engine run in a loop, for a profiler to attach to.

    python -m benchmarks.profile_phase --model FILE [--cpu-isa LEVEL] --phase prefill|decode
        [--prompt-len 512] [--seconds 10]

The engine loads and warms up, then the process prints `READY pid=N` and runs the phase
until `--seconds` have passed: prefills of `--prompt-len` random tokens one after the other,
or batch-1 decode of one request of 128 prompt tokens restarted every 64 tokens (the same
prompt, so each restart's prefill is a prefix hit and the context stays near the latency
bench's 137-201 positions). It ends by printing the phase's mean time. Attach a profiler
once READY is printed, e.g.

    python -m benchmarks.profile_phase --model F --cpu-isa avx2 --phase prefill --seconds 12 > log &
    until grep -q READY log; do sleep 0.2; done
    perf record -F 1999 -g -p $(grep -o 'pid=[0-9]*' log | cut -d= -f2) -o perf.data -- sleep 10
    perf report -i perf.data --no-children -s pid,sym -g none --stdio

(`-s pid,sym` keeps the main thread's samples apart from the OpenMP worker's: the worker's
libgomp samples are its waits.)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cpu-isa", default=None)
    ap.add_argument("--phase", choices=("prefill", "decode"), required=True)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--kv-cache-memory", default="256MiB", help="the pool (a larger model's 4,096 positions need more)")
    args = ap.parse_args()
    if args.seconds <= 0 or args.prompt_len <= 0:
        ap.error("--seconds and --prompt-len must be positive")

    engine = LLMEngine(EngineConfig(model=args.model, cpu_isa=args.cpu_isa, kv_cache_memory=args.kv_cache_memory,
                                    max_model_len=max(4096, args.prompt_len + 1)))
    rng = np.random.default_rng(0)
    vocab = engine.arch.vocab_size
    decode_prompt = rng.integers(100, min(vocab, 20000), 128).tolist()

    def prefill() -> None:
        prompt = rng.integers(100, min(vocab, 20000), args.prompt_len).tolist()
        engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    def decode() -> None:
        if not engine.has_unfinished_requests():
            engine.add_request(None, decode_prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        engine.step()

    run = prefill if args.phase == "prefill" else decode
    for _ in range(10 if args.phase == "decode" else 1):  # warm-up: kernels built, shapes seen
        run()
    print(f"READY pid={os.getpid()}", flush=True)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        run()
        n += 1
    what = "prefill" if args.phase == "prefill" else "step"
    print(f"{(time.perf_counter() - start) * 1e3 / n:.2f} ms per {what} ({n} {what}s)", flush=True)


if __name__ == "__main__":
    main()
