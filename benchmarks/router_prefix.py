"""`python -m benchmarks.router_prefix`: the router's prefix-aware policy against
round-robin, on two replicas of this host and a workload of a few system prompts.

Two `kvserve serve` replicas (one thread each) run for the whole measurement. For each
policy in turn, alternating, a `kvserve router` is started over them and the workload goes
through it: each request is one of K system prompts (random words) and a short question of
its own, in random order, `--concurrency` at a time. Every run draws its own system
prompts, so no run finds what an earlier one cached. The figure is the replicas' own prefix
cache hit rate over the run (their `kvserve:prefix_cache_hits` / `_queries` counters, summed
over both), with the wall time beside it. Round-robin sends each system prompt to both
replicas, so each is computed twice; the prefix policy keeps each on one replica.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvserve.disagg.launch import start_and_wait

_SERVING = re.compile(r"serving (\S+) at (http://\S+)/v1")
_ROUTING = re.compile(r"router \(\S+\) at (http://\S+)/v1")
_WORDS = ("the of and to in is was for on are with as his they at be this from have or one had by word but not what all "
          "were when we there can an your which their said if do will each about how up out them then she many some so "
          "these would other into has more her two like him see time could no make than first been its who now people my "
          "made over did down only way find use may water long little very after words called just where most know").split()  # fmt: skip


def _counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["kvserve:prefix_cache_queries_total"], values["kvserve:prefix_cache_hits_total"]


def _workload(rng: np.random.Generator, num_systems: int, system_words: int, num_requests: int) -> list[list[dict]]:
    systems = [" ".join(rng.choice(_WORDS, system_words)) for _ in range(num_systems)]
    order = rng.integers(0, num_systems, num_requests)
    return [[{"role": "system", "content": systems[k]}, {"role": "user", "content": " ".join(rng.choice(_WORDS, 8))}]
            for k in order]  # fmt: skip


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-router-bench-"))
    serve = [sys.executable, "-m", "kvserve.cli", "serve", "--port", "0", "--threads", "1",
             "--kv-cache-memory", args.kv_cache_memory] + (["--model", args.model] if args.model else [])  # fmt: skip
    replicas = [start_and_wait(serve, tmp / f"replica{i}.log", _SERVING) for i in range(2)]
    urls = [m.group(2) for _, m in replicas]
    name = replicas[0][1].group(1)
    rng = np.random.default_rng(args.seed)
    results = []
    try:
        for round_ in range(args.rounds):
            for policy in ("prefix", "round-robin"):
                router, match = start_and_wait([sys.executable, "-m", "kvserve.cli", "router", "--port", "0", "--policy", policy,
                                        "--replica", *urls], tmp / f"router-{policy}-{round_}.log", _ROUTING)  # fmt: skip
                url = match.group(1)
                try:
                    work = _workload(rng, args.system_prompts, args.system_prompt_words, args.requests)
                    before = [_counters(u) for u in urls]

                    def ask(messages):
                        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                            "model": name, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0})
                        r.raise_for_status()

                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(args.concurrency) as pool:
                        list(pool.map(ask, work))
                    wall = time.perf_counter() - t0
                    after = [_counters(u) for u in urls]
                    per = httpx.get(f"{url}/health", timeout=10).json()["replicas"]
                finally:
                    router.terminate()
                    router.wait(timeout=30)
                queries = sum(a[0] - b[0] for a, b in zip(after, before))
                hits = sum(a[1] - b[1] for a, b in zip(after, before))
                results.append({"round": round_, "policy": policy, "hit_rate": hits / queries if queries else 0.0,
                                "prompt_tokens": queries, "hit_tokens": hits, "wall_s": wall,
                                "requests_per_replica": [r["requests"] for r in per]})  # fmt: skip
                print(f"round {round_} {policy:>11}: prefix-cache hit rate {results[-1]['hit_rate']:.1%} "
                      f"({hits:,.0f} of {queries:,.0f} prompt tokens), {wall:.1f} s, requests per replica "
                      f"{results[-1]['requests_per_replica']}", flush=True)  # fmt: skip
    finally:
        for proc, _ in replicas:
            proc.terminate()
            proc.wait(timeout=60)
    return {"model": name, "settings": vars(args), "results": results}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model of both replicas (default: the default model)")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-prompt-words", type=int, default=300)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="64MiB", help="per replica (default 64MiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    data = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
