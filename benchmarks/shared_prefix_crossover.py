"""Where reading a shared prefix once starts to pay: the measurement behind the engine's rule
(`--shared-prefix-min-positions`, `--shared-prefix-min-group`).

    python -m benchmarks.shared_prefix_crossover [--requests 2,4,8,16] [--prefix-lens 256,512,1024,2048]

For each (requests n, prefix length P) it loads n prompts sharing a P-token prefix (64 private
tokens each) into one engine, runs the prompts, then times decode steps alternating with and
without shared-prefix attention, the rule's thresholds forced down so every step can use it,
and prints the median step time of each and their ratio (above 1: reading once is faster).
Alternating steps within one engine keeps the comparison fair on a machine whose speed moves
between runs. Not a test; the figures depend on the machine (say which when quoting them).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve import LLM, SamplingParams


def step_ratio(llm: LLM, num_requests: int, prefix_len: int, num_prefixes: int = 1, steps: int = 60,
               private: int = 64, seed: int = 0) -> tuple[float, float]:
    """(median step ms read per request, median step ms read once) over `steps` alternating decode steps."""
    engine = llm.engine
    engine.reset_prefix_cache()
    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + [rng.randrange(3, vocab) for _ in range(private)] for i in range(num_requests)]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))  # the prefix into the cache
    ids = [f"crossover-{i}" for i in range(num_requests)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    runner = engine.runner
    configured = runner.shared_prefix_attention
    times: dict[str, list[float]] = {"off": [], "auto": []}
    try:
        for i in range(steps):
            mode = "auto" if i % 2 else "off"
            runner.shared_prefix_attention = mode
            t0 = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - t0)
    finally:
        runner.shared_prefix_attention = configured
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times["off"]) * 1e3, statistics.median(times["auto"]) * 1e3


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the default model)")
    ap.add_argument("--requests", type=_ints, default=[2, 4, 8, 16], help="group sizes, comma-separated")
    ap.add_argument("--prefix-lens", type=_ints, default=[256, 512, 1024, 2048], help="prefix lengths, comma-separated")
    ap.add_argument("--num-prefixes", type=int, default=1, help="distinct prefixes, round robin (default 1)")
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed per cell, alternating (default 60)")
    args = ap.parse_args(argv)
    biggest = max(args.requests) * (max(args.prefix_lens) + 64 + args.steps + 16)
    llm = LLM(args.model, shared_prefix_attention="auto", shared_prefix_min_positions=16, shared_prefix_min_group=2,
              max_model_len=max(args.prefix_lens) + 64 + args.steps + 16, kv_cache_memory=max(biggest * 2**15, 2**28))
    print(f"{'requests':>8} {'prefix':>7} {'per request ms':>15} {'read once ms':>13} {'ratio':>6}")
    for prefix_len in args.prefix_lens:
        for n in args.requests:
            off, on = step_ratio(llm, n, prefix_len, args.num_prefixes, args.steps)
            print(f"{n:>8} {prefix_len:>7} {off:>15.2f} {on:>13.2f} {off / on:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
